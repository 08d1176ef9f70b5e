#!/usr/bin/env bash
# Device run 12 (2026-12-01, session 15), one call, carry [".whl"] not needed:
# run 11's GLM-4.5-Air batch-32 profile put 71% of the step in _moe_gemm_kernel (262 us a call,
# ~1 TB/s on the distinct experts' bytes): the GLM / Qwen shapes had only a T = 1 bucket in the
# launch table, so 32 streams ran BM 1 tiles (each pair re-reads its expert). Tune the W2
# decode buckets of both shapes (written into the table), then engine_bench both models.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
mkdir -p $OUT/tune $OUT/engine
el "tune"
timeout --signal=INT 230 python -m moet.bench.moe_kernel_tune --out $OUT/tune --budget-s 200 --shapes glm,qwen \
    --formats w2 --tokens 1,8,32,64 --tune glm:8,glm:32,glm:64,qwen:32 --write-table > $OUT/tune/log.txt 2>&1
echo "rc=$?"; grep -v "^    " $OUT/tune/log.txt | tail -14 | cut -c1-200
cp src/moet/kernels/moe_configs.json $OUT/tune/moe_configs_merged.json
for m in glm45air qwen3_30b; do
    left=$(( 520 - ($(date +%s) - t0) )); [ $left -lt 40 ] && { el "no time for $m"; break; }
    el "engine $m"
    timeout $left python -m moet.bench.engine_bench --models $m --streams 1,8,32,64 --prefill 0 \
        --budget-s $(( left - 10 )) --out $OUT/engine/$m > $OUT/engine/log_$m.txt 2>&1
    echo "rc=$?"; grep -E "single stream|streams:|FAIL|rror" $OUT/engine/log_$m.txt | cut -c1-200
done
el "done"
