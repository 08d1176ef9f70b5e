#!/usr/bin/env bash
# Device run 30 (stop 26). Results in $OUT/<mode>.tgz.
#   bash tools/kernel_lab/run30.sh a  (~7 min) the FP8 GEMM GPU tests (the w8a8 decode rule of stop 25: x
#       quantized once by its own launch when the weight has > 16 N tiles), fp8_gemm_bench --sweep with
#       CUDA-graph timing (the decode numbers of run 29 were host-bound eager calls), and
#       moe_layer_prefix.py: the table's decode layers cut after each launch (where the 51 us of the
#       DeepSeek-V3 W2 T = 1 layer go), with and without PDL
#   bash tools/kernel_lab/run30.sh b  (~9 min) moe_bench, the issue-4 side-by-side on the current tables: moet's
#       W2 / FP4 layers, the transformers-style bf16 loop and torch._grouped_mm, all three models, decode
#       T = 1, 4, 8, 16, 32 and prefill 512 / 2048 / 8192 (last run in full: run 4, 2026-11-29, DeepSeek-V3 only)
#   bash tools/kernel_lab/run30.sh c  (~8 min) the MoE GPU tests (X_CLAMP: padding rows of a decode token tile read a
#       real x row unmasked, the same bits), X_CLAMP on (default) against --masked-x at the table configs
#       (DeepSeek-V3 / Qwen3 T = 1, 8; sm_90 AOT: W2 T = 1 gate/up 927 -> 917 loop instructions, down 283 -> 279),
#       then moe_config_probe.py: DeepSeek-V3 T = 1 variants of the run-29 table the tuner never timed (a split
#       gate/up at BM 8 / BKH 64: twice the warps, the gate/up grid holds only ~2 warps a scheduler; two chains;
#       ring depth; down tiles)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
R=/tmp/r30; mkdir -p $R
MODE=${1:-}
save() { tar czf $OUT/${MODE}.tgz -C $R . 2>/dev/null; }
case "$MODE" in
a)
    timeout -k 5 120 python -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_gemm_triton.py \
        tests/kernels/test_fp8_gemm_compiles.py > $R/pytest_fp8.txt 2>&1; echo "fp8 tests rc=$?"; tail -2 $R/pytest_fp8.txt
    timeout -k 5 120 python tools/kernel_lab/moe_layer_prefix.py --out $R/prefix > $R/log_prefix.txt 2>&1
    echo "prefix rc=$?"; grep -E "^\[" $R/log_prefix.txt | cut -c1-220; tail -3 $R/log_prefix.txt | grep -i error
    save
    timeout -k 5 --signal=INT 260 python -m moet.bench.fp8_gemm_bench --out $R/fp8 --budget-s 225 \
        --tokens 1,16,128,2048,8192 --sweep > $R/log_fp8.txt 2>&1; echo "fp8 rc=$?"; tail -40 $R/log_fp8.txt | cut -c1-200
    save ;;
b)
    timeout -k 5 --signal=INT 480 python -m moet.bench.moe_bench --out $R/bench --budget-s 440 > $R/log_bench.txt 2>&1
    echo "bench rc=$?"; tail -60 $R/log_bench.txt | cut -c1-200
    save ;;
c)
    timeout -k 5 240 python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_triton.py \
        tests/model/test_pool_layout.py > $R/pytest_moe.txt 2>&1; echo "tests rc=$?"; tail -3 $R/pytest_moe.txt
    for ab in clamp masked; do
        flag=""; [ $ab = masked ] && flag="--masked-x"
        timeout -k 5 --signal=INT 60 python -m moet.bench.moe_kernel_tune --out $R/x_$ab --budget-s 50 \
            --shapes deepseek --formats w2,fp4 --tokens 1,8 --tune "" $flag > $R/log_x_$ab.txt 2>&1
        echo "$ab rc=$?"; grep -E "^\[.*(GB/s|failed)" $R/log_x_$ab.txt | grep -v check | cut -c1-120
    done
    save
    timeout -k 5 60 python tools/kernel_lab/moe_layer_prefix.py --out $R/prefix_masked --shapes deepseek --formats w2 \
        --tokens 1 --masked-x > $R/log_prefix_masked.txt 2>&1; echo "prefix rc=$?"; grep -E "^\[" $R/log_prefix_masked.txt | cut -c1-200
    timeout -k 5 100 python tools/kernel_lab/moe_config_probe.py --out $R/probe --shape deepseek --fmt w2 --tokens 1 \
        --masked-x --variants "gu.SPLIT_K=2;fused_finish=1" "gu.SPLIT_K=2" "gu.SPLIT_K=2;gu.BKH=32;fused_finish=1" \
        "gu.chains=2" "gu.SPLIT_K=2;gu.chains=2;fused_finish=1" "gu.num_stages=3" "gu.num_stages=5" \
        "dn.BN=16;dn.num_warps=1" "dn.BKH=64" "BM=4" > $R/log_probe_w2.txt 2>&1
    echo "probe w2 rc=$?"; grep -E "^\[" $R/log_probe_w2.txt | cut -c1-160
    save ;;
*) echo "usage: run30.sh a|b|c"; exit 2 ;;
esac
