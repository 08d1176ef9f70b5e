#!/usr/bin/env bash
# Device run 10 (2026-12-01), two calls back to back:
#   bash tools/kernel_lab/run10.sh a   (carry [".whl"], ~9.5 min): serve_bench HTTP vs the Python API
#       on moet-tiny (issue 9; run 8's fastapi 0.165 lacked opentelemetry-api), residency_bench on a
#       32 GB card with the batch-4 schedule fixed, and the transformers + accelerate baseline (issue 7)
#   bash tools/kernel_lab/run10.sh b   (~7 min): run 9's kernel labs (wgmma MoE layer, bf16 wgmma
#       GEMV), then attention_bench --quick in what time is left (issues 4, 5)
python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/serve/*.whl 2>&1 | grep -v WARNING | tail -3
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
if [ "${1:-a}" = a ]; then
    python -c "import uvicorn, fastapi, pydantic, accelerate; print('deps ok', fastapi.__version__)"
    el "serve bench"
    timeout 100 python -m moet.bench.serve_bench --requests 64 --concurrency 16 --max-tokens 64 --budget-s 80 \
        --out $OUT/serve_bench.json > $OUT/serve_log.txt 2>&1; echo "rc=$?"; tail -6 $OUT/serve_log.txt | cut -c1-300
    el "residency bench"
    left=$(( 575 - ($(date +%s) - t0) ))
    mkdir -p $OUT/res
    timeout $left python -m moet.bench.residency_bench --out $OUT/res --budget-s $(( left - 15 )) --cards 32 \
        --skip-boot > $OUT/res/log.txt 2>&1; echo "rc=$?"; grep -v "it/s\]\|B/s\]" $OUT/res/log.txt | tail -40 | cut -c1-220
    el "done"
    cd $OUT && tar czf run10a.tgz res serve_bench.json serve_log.txt 2>/dev/null; ls
else
    mkdir -p $OUT/moe $OUT/bf16 $OUT/attn
    el "moe wgmma"
    timeout 190 python3 tools/kernel_lab/ptx_w2/run_moe_wgmma.py --out $OUT/moe --budget-s 150 > $OUT/moe/log.txt 2>&1
    echo "rc=$?"; tail -20 $OUT/moe/log.txt | cut -c1-200
    el "bf16 wgmma"
    timeout 140 python3 tools/kernel_lab/ptx_w2/run_wgmma_bf16.py --out $OUT/bf16 --budget-s 110 > $OUT/bf16/log.txt 2>&1
    echo "rc=$?"; tail -20 $OUT/bf16/log.txt | cut -c1-200
    el "attention"
    left=$(( 470 - ($(date +%s) - t0) ))
    timeout $left python -m moet.bench.attention_bench --quick --out $OUT/attn --budget-s $(( left - 20 )) > $OUT/attn/log.txt 2>&1
    echo "rc=$?"; tail -14 $OUT/attn/log.txt | cut -c1-200
    el "done"
    cd $OUT && tar czf run10b.tgz moe bf16 attn 2>/dev/null; ls
fi
