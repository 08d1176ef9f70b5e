#!/usr/bin/env bash
# Device run 11 (prepared 2026-12-01 for the next session), three calls, each carry [".whl"]
# (.whl/serve: the serve wheels incl. opentelemetry-api and typing_extensions; see run10.sh):
#   bash tools/kernel_lab/run11.sh train   (~9.5 min) moet-tiny recipe full-v5 (issue 8); then
#       back here: python -m tools.train_tiny.ingest <returned folder> (tools/train_tiny/README.md)
#   bash tools/kernel_lab/run11.sh res     (~9.5 min) residency_bench on the 32 GB card with the
#       batch-4 schedule fixed (issue 7)
#   bash tools/kernel_lab/run11.sh rest    (~8 min) the transformers + accelerate baseline (issue 7),
#       serve_bench HTTP vs Python API with warm phases (issue 9), attention_bench --quick with the
#       table-driven GQA decode launch defaults (issue 5)
#   bash tools/kernel_lab/run11.sh engine  (~6 min) GPU tests of today's changes (shared-expert
#       overlap, router GEMV kernel, attention launch table), then engine_bench on GLM-4.5-Air with
#       and without --overlap-shared-experts (both with the router GEMV kernel; issue 6)
# Four calls are ~34 min with starts, more than one session's 30: by value, engine and rest first
# (they finish issues 7 and 9 and measure issue 6's lever), then res, then train (needs a second
# run of the same recipe for issue 8's reproducibility check anyway).
python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/serve/*.whl 2>&1 | grep -v WARNING | tail -3
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
case "${1:-}" in
train)
    mkdir -p /tmp/run && PYTHONPATH=src:. timeout 570 python -m tools.train_tiny \
        --recipe full-v5 --out /tmp/run --pack $OUT --deadline 500; rc=$?
    cp /tmp/run/summary.json /tmp/run/run_log.jsonl $OUT/; exit $rc ;;
res)
    mkdir -p $OUT/res
    timeout 570 python -m moet.bench.residency_bench --out $OUT/res --budget-s 555 --cards 32 --skip-boot \
        --accelerate-layers 0 > $OUT/res/log.txt 2>&1; echo "rc=$?"
    grep -v "it/s\]\|B/s\]" $OUT/res/log.txt | tail -40 | cut -c1-220 ;;
rest)
    mkdir -p $OUT/acc $OUT/attn
    el "accelerate baseline"
    timeout 200 python -m moet.bench.residency_bench --out $OUT/acc --budget-s 190 --cards 32 --skip-boot \
        --skip-model > $OUT/acc/log.txt 2>&1; echo "rc=$?"; grep -v "it/s\]\|B/s\]" $OUT/acc/log.txt | tail -8
    el "serve bench"
    timeout 170 python -m moet.bench.serve_bench --phases python,http,python --requests 64 --concurrency 16 \
        --max-tokens 64 --budget-s 160 \
        --out $OUT/serve_bench.json > $OUT/serve_log.txt 2>&1; echo "rc=$?"; tail -12 $OUT/serve_log.txt | cut -c1-300
    el "attention"
    left=$(( 470 - ($(date +%s) - t0) ))
    timeout $left python -m moet.bench.attention_bench --quick --out $OUT/attn --budget-s $(( left - 20 )) \
        > $OUT/attn/log.txt 2>&1; echo "rc=$?"; tail -30 $OUT/attn/log.txt | cut -c1-200
    el "done" ;;
engine)
    mkdir -p $OUT/engine
    el "gpu tests"
    timeout 150 python -m pytest -q -p no:cacheprovider tests/model/test_shared_expert_overlap.py \
        tests/kernels/test_router_triton.py tests/kernels/test_fused_small_ops.py tests/kernels/test_attention_cuda.py \
        > $OUT/gpu_tests.txt 2>&1
    echo "rc=$?"; tail -3 $OUT/gpu_tests.txt
    for name in plain overlap; do
        flag=""; [ $name = overlap ] && flag="--overlap-shared-experts"
        el "engine glm45air $name"
        timeout 150 python -m moet.bench.engine_bench --models glm45air --streams 1,4,32 --prefill 0 \
            --budget-s 140 --out $OUT/engine/$name $flag > $OUT/engine/log_$name.txt 2>&1
        echo "rc=$?"; grep -E "single stream|streams:|FAIL" $OUT/engine/log_$name.txt | cut -c1-200
    done
    el "profile glm45air batch 32"        # where a 32-stream step goes (issue 6's 8x target)
    timeout 80 python tools/kernel_lab/engine_profile.py --out $OUT/engine --model glm45air --batch 32 --steps 10 \
        > /dev/null 2>&1; head -1 $OUT/engine/engine_profile_glm45air_b32.txt
    el "done" ;;
*) echo "usage: run11.sh train|res|rest|engine"; exit 2 ;;
esac
