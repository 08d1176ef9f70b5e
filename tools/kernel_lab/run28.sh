#!/usr/bin/env bash
# Device run 28 (stop 24). Results in $OUT/<mode>.tgz.
#   bash tools/kernel_lab/run28.sh fp4 (~6 min) FP4 on the model's new nvfp4t pools: the CUDA pool-layout tests and
#       the FP4 kernel tests; prefill A/B nvfp4t vs nvfp4 (--row-major) at T = 512 / 2048 / 8192 (run 27 timed
#       nvfp4t at decode only: T = 1 -11%, T = 8 -8%); decode re-tune on nvfp4t (--write-table)
#   bash tools/kernel_lab/run28.sh gqa (~2 min) run 26's GQA prefill launch variants at 8K (256-row tiles)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
R=/tmp/r28; mkdir -p $R
MODE=${1:-}
save() { tar czf $OUT/${MODE}.tgz -C $R . 2>/dev/null; }
case "$MODE" in
fp4)
    timeout -k 5 150 python -m pytest -q -p no:cacheprovider tests/model/test_pool_layout.py \
        tests/kernels/test_moe_triton.py -k "fp4 or pool_layout or filled" > $R/pytest_fp4.txt 2>&1
    echo "tests rc=$?"; tail -2 $R/pytest_fp4.txt
    for lay in tiled rowmajor; do
        flag=""; [ $lay = rowmajor ] && flag="--row-major"
        timeout -k 5 --signal=INT 100 python -m moet.bench.moe_kernel_tune --out $R/prefill_$lay --budget-s 85 \
            --shapes deepseek,qwen --formats fp4 --tokens 512,2048,8192 --tune "" $flag > $R/log_prefill_$lay.txt 2>&1
        echo "prefill $lay rc=$?"; grep -E "TFLOP|failed" $R/log_prefill_$lay.txt | cut -c1-170
    done
    timeout -k 5 --signal=INT 230 python -m moet.bench.moe_kernel_tune --out $R/tune --budget-s 210 \
        --shapes deepseek,qwen --formats fp4 --tokens 1,8 --tune deepseek:1,deepseek:8,qwen:1,qwen:8 \
        --write-table > $R/log_tune.txt 2>&1; echo "tune rc=$?"
    cp src/moet/kernels/moe_configs.json $R/moe_configs_merged.json
    grep -E "^\[.*(GB/s|failed)" $R/log_tune.txt | cut -c1-170
    save ;;
gqa)
    timeout -k 5 150 python tools/kernel_lab/gqa_decode_probe.py --out $R/gqa_prefill --prefill 8192 \
        > $R/log_gqa_prefill.txt 2>&1; echo "rc=$?"; grep -E "prefill" $R/log_gqa_prefill.txt | cut -c1-180; save ;;
*) echo "usage: run28.sh fp4|gqa"; exit 2 ;;
esac
