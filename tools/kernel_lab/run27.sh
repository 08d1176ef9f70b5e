#!/usr/bin/env bash
# Device run 27 (prepared in stop 23 for the next session). Results in $OUT/<mode>.tgz.
#   bash tools/kernel_lab/run27.sh tests   (~3 min) the GPU tests of the MoE kernels (nb8t pools: bit identity with
#       nb8 on the decode and sort paths, the token-major fallback; checked so far under the interpreter and by
#       nb8_tiled_probe's 20 bit-identical outputs) and of the model's pool layout
#   bash tools/kernel_lab/run27.sh tune    (~8 min) moe_kernel_tune decode re-tune on nb8t pools (make_pool now takes
#       the model's layout): DeepSeek-V3 and Qwen3-30B-A3B at T = 1, 2, 8 (run 26b: gate/up BKH 64 a further -5% at
#       T = 8 on the tiled pool), table merged into $R/moe_configs_merged.json
#   bash tools/kernel_lab/run27.sh prefill (~4 min) the table configs on nb8t pools at T = 512 / 2048 / 8192
#       (DeepSeek-V3, Qwen3): nb8t was timed at decode only (run 26b); run 23's W2 prefill was 50.6% of the GEMM on
#       nb8 (issue 4's >= 50%); if nb8t is slower there, the pool layout choice needs the prefill's view too
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
R=/tmp/r27; mkdir -p $R
MODE=${1:-}
save() { tar czf $OUT/${MODE}.tgz -C $R . 2>/dev/null; }
case "$MODE" in
tests)
    timeout -k 5 300 python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_triton.py \
        tests/model/test_pool_layout.py tests/formats/test_w2.py > $R/pytest_moe.txt 2>&1; echo "tests rc=$?"
    tail -3 $R/pytest_moe.txt; save ;;
tune)
    timeout -k 5 --signal=INT 500 python -m moet.bench.moe_kernel_tune --out $R/tune --budget-s 460 \
        --shapes deepseek,qwen --formats w2 --tokens 1,2,8 --tune deepseek:1,deepseek:8,qwen:1,qwen:8,deepseek:2 \
        --write-table > $R/log_tune.txt 2>&1; echo "rc=$?"
    cp src/moet/kernels/moe_configs.json $R/moe_configs_merged.json
    grep -E "^\[|GB/s|failed" $R/log_tune.txt | cut -c1-200 | tail -24
    save ;;
prefill)
    timeout -k 5 --signal=INT 280 python -m moet.bench.moe_kernel_tune --out $R/prefill --budget-s 250 \
        --shapes deepseek,qwen --formats w2 --tokens 512,2048,8192 --tune "" > $R/log_prefill.txt 2>&1; echo "rc=$?"
    grep -E "^\[|TFLOP|failed" $R/log_prefill.txt | cut -c1-200 | tail -16
    save ;;
fp4t)
    timeout -k 5 200 python tools/kernel_lab/nb8_tiled_probe.py --out $R/fp4t --formats fp4,w2 --shapes deepseek,qwen \
        --budget-s 170 > $R/log_fp4t.txt 2>&1; echo "rc=$?"; grep -E "table|BKH" $R/log_fp4t.txt | cut -c1-170 | tail -24
    save ;;
*) echo "usage: run27.sh tests|tune|prefill|fp4t"; exit 2 ;;
esac
