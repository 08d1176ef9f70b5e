#!/usr/bin/env bash
# Device run 23 (2026-12-01, stop 20). Results in one $OUT/<mode>.tgz.
#   bash tools/kernel_lab/run23.sh prefill   (~6 min) first the FP4 decode with its e4m3 scales through the hardware
#       conversion (stop 20; sm_90 AOT -12% loop instructions): moe_decode_probe FP4 at T = 1, 8 against run 21's
#       108.2 / 595 us (DeepSeek-V3); then DeepSeek-V3 W2 + FP4 prefill (T = 8192) re-tuned with the BKH-64, BN-256
#       and W2 BM-128 / BN-64 candidates (issue 4's >= 50% at T = 8192: 48.6% / 39.9% in run 21), table merged
#   bash tools/kernel_lab/run23.sh final     (~9 min) engine_bench GLM-4.5-Air and Qwen3-30B-A3B (run21.sh final)
#   bash tools/kernel_lab/run23.sh wgmma     (~3 min) the kernel lab's grouped e4m3 wgmma MoE layer (run 10: 62 us
#       at T = 1 on DeepSeek-V3 although its two GEMVs ran at 92% / 78% stacked, ~36 us) with --breakdown:
#       launches 1..n timed as prefixes, so the layer's time splits into what each launch adds
#   bash tools/kernel_lab/run23.sh rescale   (~3 min) lazy online-softmax rescaling (rescale_slack of the MLA decode /
#       prefill and the GQA prefill; attention_triton.RESCALE_SLACK = 0, eager, by default) against the eager form:
#       GPU tests of those kernels, then tools/kernel_lab/rescale_probe.py (MLA decode 32K b1/8/32, prefill 8K)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
R=/tmp/r23; mkdir -p $R
MODE=${1:-}
save() { tar czf $OUT/${MODE}.tgz -C $R . 2>/dev/null; }
case "$MODE" in
prefill)
    timeout -k 5 150 python tools/kernel_lab/moe_decode_probe.py --out $R/probe_fp4 --shapes deepseek,glm --formats fp4 \
        --tokens 1,8 --bms 1,8 --unrolls 1,2 > $R/log_probe_fp4.txt 2>&1; echo "probe rc=$?"
    grep -E "GEMV|T1 |T8 " $R/log_probe_fp4.txt | cut -c1-150; save
    timeout -k 5 --signal=INT 380 python -m moet.bench.moe_kernel_tune --out $R/tune --budget-s 350 \
        --shapes deepseek --formats w2,fp4 --tokens 8192 --tune deepseek:8192 \
        --write-table > $R/log_tune.txt 2>&1; echo "rc=$?"
    cp src/moet/kernels/moe_configs.json $R/moe_configs_merged.json
    grep -E "^\[|TFLOP|failed" $R/log_tune.txt | cut -c1-200 | tail -24
    save ;;
final)
    bash tools/kernel_lab/run21.sh final; cp -r /tmp/r21/. $R/ 2>/dev/null; save ;;
wgmma)
    timeout -k 5 240 python tools/kernel_lab/ptx_w2/run_moe_wgmma.py --out $R/wgmma --budget-s 150 \
        --shapes deepseek,glm --tokens 1,8 --cfgs 1x2s4/1x1s4/pdl,1x2s4/1x1s4 --breakdown \
        > $R/log_wgmma.txt 2>&1; echo "rc=$?"; grep -E "breakdown|time " $R/log_wgmma.txt | cut -c1-260
    save ;;
rescale)
    timeout -k 5 150 python -m pytest -q -p no:cacheprovider tests/kernels/test_attention_triton.py \
        tests/kernels/test_prefill_triton.py tests/kernels/test_mla_prefill_triton.py tests/kernels/test_attention_cuda.py \
        > $R/pytest_attn.txt 2>&1; echo "tests rc=$?"; tail -2 $R/pytest_attn.txt; save
    timeout -k 5 240 python tools/kernel_lab/rescale_probe.py --out $R/rescale > $R/log_rescale.txt 2>&1
    echo "probe rc=$?"; cut -c1-400 $R/log_rescale.txt | tail -12
    save ;;
*) echo "usage: run23.sh prefill|final|wgmma|rescale"; exit 2 ;;
esac
