#!/usr/bin/env bash
# Device run 16 (2026-12-01), carry [".whl"]: async scheduling on by default + the one-round-trip
# router GEMV (BK 4096, 8 warps). Results in one $OUT/<mode>.tgz.
#   bash tools/kernel_lab/run16.sh engine   router GPU tests, engine_bench GLM-4.5-Air 1/8/32 + Qwen3 1/32,
#                                           GLM batch-1 profile with async steps (GPU timeline)
python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/serve/*.whl 2>&1 | grep -v WARNING | tail -3
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
R=/tmp/r16; mkdir -p $R/engine
case "${1:-}" in
engine)
    [ "${2:-}" = bench ] || {
    timeout -k 5 120 python -m pytest -q -p no:cacheprovider tests/kernels/test_router_triton.py > $R/gpu_tests.txt 2>&1
    echo "router tests rc=$?"; tail -1 $R/gpu_tests.txt; }
    for spec in "glm45air 1,8,32" "qwen3_30b 1,32"; do
        m=${spec% *}; st=${spec#* }
        el "engine $m"
        timeout -k 5 170 python -m moet.bench.engine_bench --models $m --streams $st --prefill 0 $FLAGS \
            --budget-s 160 --out $R/engine/$m > $R/engine/log_$m.txt 2>&1
        echo "rc=$?"; grep -E "correctness|single stream|streams:|FAIL|rror|budget" $R/engine/log_$m.txt | cut -c1-240
    done
    el "profile glm45air batch 1 (async)"
    timeout -k 5 80 python tools/kernel_lab/engine_profile.py --out $R/engine --model glm45air --batch 1 --steps 10 \
        > /dev/null 2>&1; head -1 $R/engine/engine_profile_glm45air_b1.txt
    grep -A8 "GPU timeline" $R/engine/engine_profile_glm45air_b1.txt | cut -c1-200
    grep -E "_router_g|_rou|nvjet|_moe_g" $R/engine/engine_profile_glm45air_b1.txt | cut -c1-60,100-170 | head -8
    rm -f $R/engine/engine_trace_*.json
    el "done" ;;
*) echo "usage: run16.sh engine"; exit 2 ;;
esac
tar czf $OUT/${1}.tgz -C $R .
