#!/usr/bin/env bash
# Device run 21 (2026-12-01, stop 19). Results in one $OUT/<mode>.tgz, tarred after every step.
#   bash tools/kernel_lab/run21.sh moe       (~5 min) GPU tests of the grouped MoE kernels, then
#       tools/kernel_lab/moe_decode_probe.py: the table's decode configs with BM 1/4/8 and the K loop
#       unrolled 1/2 (run 20's Nsight Compute: the x loads of BM < 4 tiles are the decode GEMMs' top stall)
#   bash tools/kernel_lab/run21.sh prefill   (~9 min) = run20.sh prefill (issue 4's prefill target)
#   bash tools/kernel_lab/run21.sh mix       (~5 min) GPU tests of the attention kernels (the vectorized split
#       merge), gqa_decode_probe with --amortize 4 (graphs of 4 calls over 4 caches), and DeepSeek-V3 W2
#       prefill re-tuned with the whole BM-128 two-stage configs
#   bash tools/kernel_lab/run21.sh final     (~9 min) engine_bench GLM-4.5-Air and Qwen3-30B-A3B as run19.sh final
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
R=/tmp/r21; mkdir -p $R
MODE=${1:-}
save() { tar czf $OUT/${MODE}.tgz -C $R . 2>/dev/null; }
case "$MODE" in
moe)
    el "GPU tests: grouped MoE kernels"
    timeout -k 5 150 python -m pytest -q -x tests/kernels/test_moe_triton.py > $R/pytest_moe.txt 2>&1
    echo "rc=$?"; tail -3 $R/pytest_moe.txt; save
    el "probe: deepseek T 1, 8"
    timeout -k 5 200 python tools/kernel_lab/moe_decode_probe.py --out $R/probe_ds --shapes deepseek --tokens 1,8 \
        > $R/log_probe_ds.txt 2>&1; echo "rc=$?"; grep -E "GEMV|T1 |T8 " $R/log_probe_ds.txt | cut -c1-150; save
    el "probe: glm, qwen T 1"
    timeout -k 5 170 python tools/kernel_lab/moe_decode_probe.py --out $R/probe_gq --shapes glm,qwen --tokens 1 \
        > $R/log_probe_gq.txt 2>&1; echo "rc=$?"; grep -E "GEMV|T1 " $R/log_probe_gq.txt | cut -c1-150; save
    el done ;;
prefill)
    timeout -k 5 --signal=INT 560 python -m moet.bench.moe_kernel_tune --out $R/tune --budget-s 540 \
        --shapes deepseek,glm --formats w2,fp4 --tokens 8192 --tune deepseek:8192,glm:8192 \
        --write-table > $R/log_tune.txt 2>&1; echo "rc=$?"
    grep -E "^\[|TFLOP|failed" $R/log_tune.txt | cut -c1-220 | tail -20
    save ;;
mix)
    # ordered by what must not be lost if the session's device time runs out
    el "GPU tests: attention kernels"
    timeout -k 5 100 python -m pytest -q -p no:cacheprovider tests/kernels/test_attention_cuda.py \
        tests/kernels/test_attention_triton.py > $R/pytest_attn.txt 2>&1; echo "rc=$?"; tail -2 $R/pytest_attn.txt; save
    el "DeepSeek-V3 W2 prefill tune"
    timeout -k 5 --signal=INT 170 python -m moet.bench.moe_kernel_tune --out $R/tune_ds --budget-s 150 \
        --shapes deepseek --formats w2 --tokens 8192 --tune deepseek:8192 > $R/log_tune_ds.txt 2>&1; echo "rc=$?"
    grep -E "^\[|failed" $R/log_tune_ds.txt | cut -c1-220 | tail -6; save
    el "engine glm45air"
    timeout -k 5 150 python -m moet.bench.engine_bench --models glm45air --streams 1,32 --prefill 8192 \
        --budget-s 140 --out $R/glm45air > $R/log_glm45air.txt 2>&1
    echo "rc=$?"; grep -E "single stream|streams:|prefill|FAIL|rror|budget|GEMV" $R/log_glm45air.txt | cut -c1-220; save
    el "GQA decode probe, amortized"
    timeout -k 5 90 python tools/kernel_lab/gqa_decode_probe.py --out $R/probe --amortize 4 --only base,base_pdl,splits64 \
        --batches 1,32 > $R/log_probe.txt 2>&1; echo "rc=$?"; grep -E "^\[|\|" $R/log_probe.txt | cut -c1-200; save
    el done ;;
final)
    for spec in "glm45air 1,4,8,16,32,64 " "qwen3_30b 1,4,8,16,32,64 --hf-baseline"; do
        set -- $spec; m=$1; st=$2; extra=${3:-}
        el "engine $m $extra"
        timeout -k 5 280 python -m moet.bench.engine_bench --models $m --streams $st --prefill 8192 $extra \
            --budget-s 270 --out $R/$m > $R/log_$m.txt 2>&1
        echo "rc=$?"; grep -E "single stream|streams:|prefill|transformers|generate|FAIL|rror|budget|GEMV" $R/log_$m.txt | cut -c1-220
        save
    done ;;
*) echo "usage: run21.sh moe|prefill|mix|final"; exit 2 ;;
esac
