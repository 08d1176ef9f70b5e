#!/usr/bin/env bash
# Device run 29 (prepared in stop 24 for the next session). Results in $OUT/<mode>.tgz.
#   bash tools/kernel_lab/run29.sh tests (~3 min) the MoE kernel GPU tests: two MMA chains a step
#       (GemmConfig.chains 2: gate/up the same bits as one chain, down close; checked so far under the
#       interpreter and compiled by the sm_90 AOT build only), the down prefetch (GPU-only test: same
#       bits as PDL alone) and the nvfp4t model pools
#   bash tools/kernel_lab/run29.sh even  (~2 min) A/B of the constant-mask tiles (moe_triton.UNMASK_EVEN_TILES, on
#       by default since stop 24: sm_90 AOT 3-7% fewer loop instructions, the same bits): the table configs at
#       DeepSeek-V3 / Qwen3 T = 1, 8, W2 and FP4, with and without --masked-tiles, in one call
#   bash tools/kernel_lab/run29.sh tune  (~9 min) decode retune, W2 and FP4 at DeepSeek-V3 T = 1 / 8 and
#       Qwen3 T = 1, with the new candidates: two MMA chains (gate/up, down), the down L2 prefetch under PDL
#       (MoEConfig.down_prefetch), and the whole configs the greedy sweep
#       could not reach (BM 4 + gate/up BKH 64 unsplit: FP4's run-28 winner, 93.1 -> 77.6 us, never timed
#       for W2, whose sweep kept BM 1); the table merged into $R/moe_configs_merged.json (copy it to
#       src/moet/kernels/moe_configs.json if the log shows gains)
#   bash tools/kernel_lab/run29.sh prefill (~5 min) prefill retune at DeepSeek-V3 T = 8192 on the row-tiled pools
#       (W2 50.9%, FP4 44.6% of the GEMM in run 28 with tables tuned on row-major pools; two-chain gate/up
#       is a new prefill candidate), merged into the table
#   bash tools/kernel_lab/run29.sh fp8   (~4 min) the FP8 block-128 dense GEMM bench (issue 4 item 3): its
#       numbers were never written to docs/perf.md; DeepSeek-V3's dense shapes at T = 1 / 16 / 128 / 2048 / 8192,
#       w8a8 and w8a16 against torch's bf16 F.linear and torch._scaled_mm, --sweep for the launch table
#   bash tools/kernel_lab/run29.sh mla   (~1 min) the MLA prefill at 8K with 16-warp variants (GQA's won 32% in
#       run 28; the MLA tile spills at 16 warps in the sm_90 AOT build, so only a measurement can say)
#   bash tools/kernel_lab/run29.sh short (~1 min) the GQA prefill launches at 512 and 2048 tokens (run 28
#       adopted 256 rows x 16 warps from 8K; a 512-token Qwen3 prompt makes only 64 programs of it)
# Each device call starts from this checkout's table, so tune and prefill each merge into their own
# copy: merge their tuned entries ($R/tune/moe_configs.json, $R/prefill/moe_configs.json) here with
# moet.bench.moe_kernel_tune.merge_table(new, "src/moet/kernels/moe_configs.json").
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
R=/tmp/r29; mkdir -p $R
MODE=${1:-}
save() { tar czf $OUT/${MODE}.tgz -C $R . 2>/dev/null; }
case "$MODE" in
tests)
    timeout -k 5 300 python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_triton.py \
        tests/model/test_pool_layout.py > $R/pytest_moe.txt 2>&1; echo "tests rc=$?"; tail -3 $R/pytest_moe.txt
    save ;;
even)
    for ab in unmasked masked; do
        flag=""; [ $ab = masked ] && flag="--masked-tiles"
        timeout -k 5 --signal=INT 75 python -m moet.bench.moe_kernel_tune --out $R/even_$ab --budget-s 65 \
            --shapes deepseek,qwen --formats w2,fp4 --tokens 1,8 --tune "" $flag > $R/log_even_$ab.txt 2>&1
        echo "$ab rc=$?"; grep -E "^\[.*(GB/s|failed)" $R/log_even_$ab.txt | grep -v check | cut -c1-120
    done
    save ;;
tune)
    timeout -k 5 --signal=INT 540 python -m moet.bench.moe_kernel_tune --out $R/tune --budget-s 500 \
        --shapes deepseek,qwen --formats w2,fp4 --tokens 1,8 --tune deepseek:1,deepseek:8,qwen:1 \
        --write-table > $R/log_tune.txt 2>&1; echo "rc=$?"
    cp src/moet/kernels/moe_configs.json $R/moe_configs_merged.json
    grep -E "^\[.*(GB/s|failed)|chains.: 2|breakdown" $R/log_tune.txt | cut -c1-200 | tail -40
    save ;;
prefill)
    timeout -k 5 --signal=INT 330 python -m moet.bench.moe_kernel_tune --out $R/prefill --budget-s 300 \
        --shapes deepseek --formats w2,fp4 --tokens 8192 --tune deepseek:8192 --write-table \
        > $R/log_prefill.txt 2>&1; echo "rc=$?"
    cp src/moet/kernels/moe_configs.json $R/moe_configs_merged_prefill.json
    grep -E "^\[.*(TFLOP|failed)" $R/log_prefill.txt | cut -c1-200 | tail -8
    save ;;
fp8)
    timeout -k 5 --signal=INT 280 python -m moet.bench.fp8_gemm_bench --out $R/fp8 --budget-s 240 \
        --tokens 1,16,128,2048,8192 --sweep > $R/log_fp8.txt 2>&1; echo "rc=$?"; tail -30 $R/log_fp8.txt | cut -c1-200
    save ;;
mla)
    timeout -k 5 150 python tools/kernel_lab/mla_decode_probe.py --out $R/mla --batches "" --prefill 8192 \
        > $R/log_mla_prefill.txt 2>&1; echo "rc=$?"; grep -E "prefill" $R/log_mla_prefill.txt | cut -c1-170
    save ;;
short)
    for n in 512 2048; do
        timeout -k 5 100 python tools/kernel_lab/gqa_decode_probe.py --out $R/gqa_prefill_$n --prefill $n \
            --kv bf16,fp8,fp8-block > $R/log_gqa_prefill_$n.txt 2>&1; echo "prefill $n rc=$?"
        grep -E "prefill .*(base|256 rows w16 s2|256 rows:|128 rows w8)" $R/log_gqa_prefill_$n.txt | cut -c1-150
    done
    save ;;
*) echo "usage: run29.sh tests|even|tune|prefill|fp8|mla|short"; exit 2 ;;
esac
