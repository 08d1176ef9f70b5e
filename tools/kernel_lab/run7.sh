#!/usr/bin/env bash
# Device run 7 (2026-11-29): run 6's serve and residency stages after their fixes (serve wheels
# for the box's Python, page-aligned pinned arena), the rope GPU test. One call:
#   bash tools/kernel_lab/run7.sh   (carry [".whl"]; results under $OUT)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
pyv=$(python -c "import sys; print(f\"cp{sys.version_info[0]}{sys.version_info[1]}\")")
python -m pip install -q --no-deps $(ls .whl/serve/*.whl | grep -v pydantic_core) .whl/serve/pydantic_core-*-$pyv-*.whl 2>&1 | grep -v WARNING | tail -3
python -c "import uvicorn, fastapi, pydantic; print(\"serve deps ok\")"
python -m pip install -q --no-deps .whl/bench/*.whl 2>&1 | tail -1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
el "gpu tests"
timeout 40 python -m pytest -q -x -p no:cacheprovider tests/kernels/test_norm_rope_triton.py > $OUT/gpu_tests.txt 2>&1
echo "rc=$?" >> $OUT/gpu_tests.txt; tail -2 $OUT/gpu_tests.txt
el "serve bench"
timeout 90 python -m moet.bench.serve_bench --requests 64 --concurrency 16 --max-tokens 64 --budget-s 70 \
    --out $OUT/serve_bench.json > $OUT/serve_log.txt 2>&1; echo "rc=$?"; tail -32 $OUT/serve_log.txt | cut -c1-200
el "residency bench"
left=$(( 470 - ($(date +%s) - t0) ))
mkdir -p $OUT/res
timeout $left python -m moet.bench.residency_bench --out $OUT/res --budget-s $(( left - 30 )) --cards 32 --boot-layers 1 \
    > $OUT/res/log.txt 2>&1; echo "rc=$?"; tail -40 $OUT/res/log.txt | cut -c1-220
el "done"
