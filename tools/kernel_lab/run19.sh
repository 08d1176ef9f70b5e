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
serve)
    # the server's first requests after the serving-shaped warm-up (compile_warmup's second part) and
    # the JIT watch that names what makes a late variant new; as run18.sh serve otherwise
    python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/serve/*.whl 2>&1 | grep -v WARNING | tail -3
    export PYTHONPATH=$PWD/src:/tmp/site
    timeout -k 5 300 python -m moet.bench.serve_bench --phases http,python,http_process --requests 64 --concurrency 16 \
        --max-tokens 64 --budget-s 280 --out $R/serve_bench.json > $R/log_serve.txt 2>&1
    echo "rc=$?"; grep -E "^\[(python|http|http_process)\] \{|correct|rror" $R/log_serve.txt | cut -c1-300
    grep -E "compile warm-up|JIT while serving|GC pause" $R/log_serve.txt | cut -c1-300 | head -20
    python - <<'PY'
import json
d = json.load(open("/tmp/r19/serve_bench.json"))
for ph in d.get("order", []):
    r = d[ph]
    print(ph, "p50", r.get("latency_p50_s"), "p99", r.get("latency_p99_s"), json.dumps(r.get("stalls_while_serving"))[:900])
PY
    save serve ;;
probe)
    # issue 5: what holds the batch-1 GQA decode (tools/kernel_lab/gqa_decode_probe.py: the production
    # kernel on caches that differ only in layout, table order and page size)
    timeout -k 5 300 python tools/kernel_lab/gqa_decode_probe.py --out $R/probe > $R/log_probe.txt 2>&1
    echo "rc=$?"; tail -12 $R/log_probe.txt; grep -E "rror|Traceback" $R/log_probe.txt | head -5
    save probe ;;
*) echo "usage: run19.sh final|serve|probe"; exit 2 ;;
esac
