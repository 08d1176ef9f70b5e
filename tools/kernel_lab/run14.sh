#!/usr/bin/env bash
# Device run 14 (2026-12-01, second session), carry [".whl"] (.whl/serve as in run11.sh). Each mode packs
# its results into one $OUT/<mode>.tgz (the device returns at most 8 files).
#   bash tools/kernel_lab/run14.sh tm      issue 4: the token-major GPU tests (run 13 found Triton's
#       "inconsistent return types" in _op_cast), tune T = 1 and 2 with the token-major candidates
#       (table written), engine_bench single stream GLM + Qwen; then run13.sh rest (attention + serve)
#   bash tools/kernel_lab/run14.sh res     run13.sh res with RES_BUDGET seconds (default 380)
#   bash tools/kernel_lab/run13.sh train   unchanged
python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/serve/*.whl 2>&1 | grep -v WARNING | tail -3
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
R=/tmp/r14; mkdir -p $R
case "${1:-}" in
tm)
    mkdir -p $R/tune $R/engine $R/attn
    el "token-major gpu tests"
    timeout 120 python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_triton.py > $R/gpu_tests.txt 2>&1
    echo "rc=$?"; grep -E "FAILED|passed|failed" $R/gpu_tests.txt | tail -6
    el "tune T 1, 2"
    timeout --signal=INT 140 python -m moet.bench.moe_kernel_tune --out $R/tune --budget-s 120 \
        --shapes glm,qwen,deepseek --formats w2 --tokens 1,2 --tune glm:1,glm:2,qwen:1,qwen:2,deepseek:1 \
        --write-table > $R/tune/log.txt 2>&1; echo "rc=$?"; grep -v "^    " $R/tune/log.txt | grep -v "^  File\|^\s" | tail -12 | cut -c1-220
    grep -c "token-major" $R/tune/log.txt; grep -i "error" $R/tune/log.txt | sort | uniq -c | head -5 | cut -c1-200
    for m in glm45air qwen3_30b; do
        el "engine $m"
        timeout 90 python -m moet.bench.engine_bench --models $m --streams 1 --prefill 0 \
            --budget-s 80 --out $R/engine/$m > $R/engine/log_$m.txt 2>&1
        echo "rc=$?"; grep -E "single stream|streams:|FAIL|rror" $R/engine/log_$m.txt | cut -c1-200
    done
    el "attention"
    timeout 150 python -m moet.bench.attention_bench --quick --out $R/attn --budget-s 130 \
        > $R/attn/log.txt 2>&1; echo "rc=$?"; grep -A12 "GQA decode GB/s per setting" $R/attn/log.txt | cut -c1-200
    el "serve bench"
    timeout 150 python -m moet.bench.serve_bench --phases python,http,http_process,python --requests 64 \
        --concurrency 16 --max-tokens 64 --budget-s 140 --out $R/serve_bench.json > $R/serve_log.txt 2>&1
    echo "rc=$?"; tail -8 $R/serve_log.txt | cut -c1-300
    el "done" ;;
res)
    mkdir -p $R/res
    b=${RES_BUDGET:-380}
    timeout $(( b + 15 )) python -m moet.bench.residency_bench --out $R/res --budget-s $b --cards 32 --skip-boot \
        --accelerate-layers 0 --step-tokens 64 --decode-modes eager > $R/res/log.txt 2>&1; echo "rc=$?"
    grep -v "it/s\]\|B/s\]" $R/res/log.txt | tail -40 | cut -c1-220 ;;
*) echo "usage: run14.sh tm|res"; exit 2 ;;
esac
tar czf $OUT/${1}.tgz -C $R .
