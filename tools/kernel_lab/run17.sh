#!/usr/bin/env bash
# Device run 17 (2026-12-01), carry [".whl"]: the engine with async scheduling on by default and the
# one-round-trip router GEMV, at every stream count, with the synchronous steps as the A/B in the
# same call. Results in $OUT/final.tgz.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
R=/tmp/r17f; mkdir -p $R
for spec in "glm45air 1,4,8,16,32,64 async" "glm45air 1,32 sync" "qwen3_30b 1,4,8,16,32,64 async"; do
    set -- $spec; m=$1; st=$2; tag=$3
    flag=""; [ $tag = sync ] && flag=--no-async-scheduling
    el "engine $m $tag"
    timeout -k 5 150 python -m moet.bench.engine_bench --models $m --streams $st --prefill 0 $flag \
        --budget-s 140 --out $R/${m}_$tag > $R/log_${m}_$tag.txt 2>&1
    echo "rc=$?"; grep -E "single stream|streams:|FAIL|rror|budget" $R/log_${m}_$tag.txt | cut -c1-200
done
tar czf $OUT/final.tgz -C $R .
