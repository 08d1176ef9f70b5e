#!/usr/bin/env bash
# Device run 15 (prepared 2026-12-01 for the next session), carry [".whl"] (.whl/serve as in run11.sh).
# Each mode packs its results into one $OUT/<mode>.tgz (the device returns at most 8 files).
#   bash tools/kernel_lab/run15.sh fused   (~8 min) issues 4 + 6: the one-launch persistent MoE decode
#       (MoEConfig.fused, kernels/moe_fused_decode.py; never run on a GPU yet). First its GPU tests
#       under a hard timeout (its programs wait on each other: a bug can hang the GPU, and SIGINT cannot
#       interrupt a blocked synchronize, hence -k), then tune T = 1 / 2 with the fused candidates
#       (written into the table when >= 2% faster and correct), then engine_bench GLM-4.5-Air + Qwen3
#       at 1 and 32 streams, and the GLM batch-1 profile
#   bash tools/kernel_lab/run15.sh async   (~5 min) issue 6: EngineConfig.async_scheduling (decode steps one
#       step ahead of the host; never run on a GPU yet): engine_bench GLM-4.5-Air 1 / 8 / 32 streams without
#       and with --async-scheduling in the same call (correctness: six runs bit-identical, reference agreement)
#   bash tools/kernel_lab/run15.sh attn    (~3 min) issue 5: attention_bench --quick with the programs
#       co-resident at more splits (256/64 s3, 256/64/32 s5, 256/128/32 s3; run 14 ran them in waves)
python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/serve/*.whl 2>&1 | grep -v WARNING | tail -3
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
R=/tmp/r15; mkdir -p $R
case "${1:-}" in
fused)
    mkdir -p $R/tune $R/engine
    el "fused + token-major gpu tests"
    timeout -k 5 150 python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_triton.py > $R/gpu_tests.txt 2>&1
    rc=$?; echo "rc=$rc"; grep -E "FAILED|passed|failed" $R/gpu_tests.txt | tail -6
    if [ $rc -ne 0 ]; then el "tests failed or hung: no tuning"; tar czf $OUT/fused.tgz -C $R .; exit 1; fi
    el "tune T 1, 2 (fused candidates first)"
    timeout -k 5 --signal=INT 200 python -m moet.bench.moe_kernel_tune --out $R/tune --budget-s 180 \
        --shapes glm,qwen,deepseek --formats w2 --tokens 1,2 --tune glm:1,qwen:1,deepseek:1,glm:2 \
        --write-table > $R/tune/log.txt 2>&1; echo "rc=$?"
    grep -E "^\[|fused|merged" $R/tune/log.txt | grep -v "^\s*File" | cut -c1-220 | tail -40
    cp src/moet/kernels/moe_configs.json $R/tune/moe_configs_merged.json
    el "profile glm45air batch 1"
    timeout -k 5 70 python tools/kernel_lab/engine_profile.py --out $R/engine --model glm45air --batch 1 --steps 10 \
        > /dev/null 2>&1; head -1 $R/engine/engine_profile_glm45air_b1.txt
    grep -E "_fused|_moe_gemm|_tm_|_prep_small|_combine|_swiglu_finish" $R/engine/engine_profile_glm45air_b1.txt | cut -c1-60,100-170 | head
    rm -f $R/engine/engine_trace_*.json
    for m in glm45air qwen3_30b; do
        left=$(( 540 - ($(date +%s) - t0) )); [ $left -lt 50 ] && { el "no time for $m"; break; }
        el "engine $m"
        timeout -k 5 $left python -m moet.bench.engine_bench --models $m --streams 1,32 --prefill 0 \
            --budget-s $(( left - 10 )) --out $R/engine/$m > $R/engine/log_$m.txt 2>&1
        echo "rc=$?"; grep -E "single stream|streams:|FAIL|rror|budget" $R/engine/log_$m.txt | cut -c1-200
    done
    el "done" ;;
async)
    mkdir -p $R/engine
    for flag in "" "--async-scheduling"; do
        tag=${flag:-sync}; tag=${tag#--}
        el "engine glm45air $tag"
        timeout -k 5 175 python -m moet.bench.engine_bench --models glm45air --streams 1,8,32 --prefill 0 $flag \
            --budget-s 165 --out $R/engine/$tag > $R/engine/log_$tag.txt 2>&1
        echo "rc=$?"; grep -E "correctness|single stream|streams:|FAIL|rror|budget" $R/engine/log_$tag.txt | cut -c1-240
    done
    el "done" ;;
attn)
    mkdir -p $R/attn
    timeout -k 5 170 python -m moet.bench.attention_bench --quick --out $R/attn --budget-s 150 \
        > $R/attn/log.txt 2>&1; echo "rc=$?"; grep -A14 "GQA decode GB/s per setting" $R/attn/log.txt | cut -c1-200 ;;
*) echo "usage: run15.sh fused|async|attn"; exit 2 ;;
esac
tar czf $OUT/${1}.tgz -C $R .
