#!/usr/bin/env bash
# Device run 13 (prepared 2026-12-01 for the next session), carry [".whl"] (.whl/serve as in run11.sh):
#   bash tools/kernel_lab/run13.sh kern    (~7 min) issues 4 + 6: GPU tests of the MoE kernels (the new
#       token-major path on CUDA), the resized one-program slot alignment (moe_align_probe: prep time
#       at 8 / 256 / 512 pairs), tune T = 1 and 2 with the token-major candidates (written into the
#       table), then engine_bench GLM-4.5-Air and Qwen3-30B (shared-expert overlap now on by default)
#   bash tools/kernel_lab/run13.sh rest    (~4 min) issue 5: attention_bench --quick (more splits at
#       batch 1); issue 9: serve_bench python / http (engine thread) / http_process (moet serve --engine-process true) / python
#   bash tools/kernel_lab/run13.sh res     (~8 min) issue 7: residency_bench on the 32 GB card with
#       64-token prefill steps (demand fetch: prefill no longer capped at 8 tokens per step); compare
#       e2e tok/s (prefill included) with run 11's 4-token steps (4.2 tok/s e2e at batch 1), and strict
#       decode as eager + demand fetch (expert_decode_mode eager) against graph + replay (37.8 tok/s);
#       if eager wins, make expert_decode_mode auto (or eager) the default
#   bash tools/kernel_lab/run13.sh train   (~9.5 min) issue 8: same-seed re-run of the shipped recipe
#       (RECIPE=full-v5: shipped 2026-12-01), then: python -m tools.train_tiny.compare
python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/serve/*.whl 2>&1 | grep -v WARNING | tail -3
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
case "${1:-}" in
kern)
    mkdir -p $OUT/tune $OUT/engine
    el "gpu tests"
    timeout 150 python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_triton.py \
        tests/model/test_shared_expert_overlap.py > $OUT/gpu_tests.txt 2>&1; echo "rc=$?"; tail -3 $OUT/gpu_tests.txt
    el "align probe"
    timeout 80 python tools/kernel_lab/moe_align_probe.py > $OUT/align_probe.txt 2>&1; echo "rc=$?"
    grep -v Warn $OUT/align_probe.txt | tail -18
    el "tune T 1, 2"
    timeout --signal=INT 170 python -m moet.bench.moe_kernel_tune --out $OUT/tune --budget-s 150 \
        --shapes glm,qwen,deepseek --formats w2 --tokens 1,2 --tune glm:1,glm:2,qwen:1,qwen:2,deepseek:1 \
        --write-table > $OUT/tune/log.txt 2>&1; echo "rc=$?"; grep -v "^    " $OUT/tune/log.txt | tail -10 | cut -c1-200
    grep "token-major" $OUT/tune/log.txt | cut -c1-200 | head -30
    el "profile glm45air batch 1"       # the router GEMV (now one expert per program) vs run 8's cuBLAS pair
    timeout 70 python tools/kernel_lab/engine_profile.py --out $OUT/engine --model glm45air --batch 1 --steps 10 \
        > /dev/null 2>&1; head -1 $OUT/engine/engine_profile_glm45air_b1.txt
    grep -E "_router_gemv|_moe_gemm|_tm_|_prep_small|_combine|_swiglu_finish" $OUT/engine/engine_profile_glm45air_b1.txt | cut -c1-60,100-170 | head
    for m in glm45air qwen3_30b; do
        left=$(( 540 - ($(date +%s) - t0) )); [ $left -lt 40 ] && { el "no time for $m"; break; }
        el "engine $m"
        timeout $left python -m moet.bench.engine_bench --models $m --streams 1,8,32,64 --prefill 0 \
            --budget-s $(( left - 10 )) --out $OUT/engine/$m > $OUT/engine/log_$m.txt 2>&1
        echo "rc=$?"; grep -E "single stream|streams:|FAIL|rror" $OUT/engine/log_$m.txt | cut -c1-200
    done
    el "done" ;;
rest)
    mkdir -p $OUT/attn
    el "attention"
    timeout 150 python -m moet.bench.attention_bench --quick --out $OUT/attn --budget-s 130 \
        > $OUT/attn/log.txt 2>&1; echo "rc=$?"; grep -A12 "GQA decode GB/s per setting" $OUT/attn/log.txt | cut -c1-200
    el "serve bench"
    timeout 300 python -m moet.bench.serve_bench --phases ${SERVE_PHASES:-python,http,http_process,python} --requests 64 \
        --concurrency 16 --max-tokens 64 --budget-s 280 --out $OUT/serve_bench.json > $OUT/serve_log.txt 2>&1
    echo "rc=$?"; tail -12 $OUT/serve_log.txt | cut -c1-300
    el "done" ;;
res)
    mkdir -p $OUT/res
    timeout 560 python -m moet.bench.residency_bench --out $OUT/res --budget-s 545 --cards 32 --skip-boot \
        --accelerate-layers 0 --step-tokens 64 --decode-modes eager > $OUT/res/log.txt 2>&1; echo "rc=$?"
    grep -v "it/s\]\|B/s\]" $OUT/res/log.txt | tail -40 | cut -c1-220 ;;
train)
    mkdir -p /tmp/run && PYTHONPATH=src:. timeout 570 python -m tools.train_tiny \
        --recipe ${RECIPE:-full-v5} --out /tmp/run --pack $OUT --deadline 500; rc=$?
    cp /tmp/run/summary.json /tmp/run/run_log.jsonl $OUT/; exit $rc ;;
*) echo "usage: run13.sh kern|rest|res|train"; exit 2 ;;
esac
