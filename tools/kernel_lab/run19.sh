#!/usr/bin/env bash
# Device run 19 (2026-12-01), carry [".whl"]: issue 6's record in one call with the defaults of
# run 18 (small_kernel_pdl on): GLM-4.5-Air and Qwen3-30B-A3B at 1-64 streams, the 8K prefill, and
# transformers' generate() on the Qwen3 shape in BF16 in the same run. Results in $OUT/final.tgz.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
R=/tmp/r19; mkdir -p $R
save() { tar czf $OUT/${1:-final}.tgz -C $R . 2>/dev/null; }
case "${1:-}" in
final)
    for spec in "glm45air 1,4,8,16,32,64 " "qwen3_30b 1,4,8,16,32,64 --hf-baseline"; do
        set -- $spec; m=$1; st=$2; extra=${3:-}
        el "engine $m $extra"
        timeout -k 5 280 python -m moet.bench.engine_bench --models $m --streams $st --prefill 8192 $extra \
            --budget-s 270 --out $R/$m > $R/log_$m.txt 2>&1
        echo "rc=$?"; grep -E "single stream|streams:|prefill|transformers|generate|FAIL|rror|budget|GEMV" $R/log_$m.txt | cut -c1-220
        save final
    done ;;
*) echo "usage: run19.sh final"; exit 2 ;;
esac
