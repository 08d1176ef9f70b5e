#!/usr/bin/env bash
# Device run 6 (2026-11-29): the fused small-op kernels' GPU tests, the engine bench after the
# launch-overhead work, serve_bench (HTTP vs Python API), residency_bench (issue 7). One call:
#   bash tools/kernel_lab/run6.sh   (carry [".whl"]; results under $OUT)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
pyv=$(python -c "import sys; print(f\"cp{sys.version_info[0]}{sys.version_info[1]}\")")
python -m pip install -q --no-deps $(ls .whl/serve/*.whl | grep -v pydantic_core) .whl/serve/pydantic_core-*-$pyv-*.whl 2>&1 | grep -v WARNING | tail -3
python -c "import uvicorn, fastapi, pydantic; print(\"serve deps ok\")"
python -m pip install -q --no-deps .whl/bench/*.whl 2>&1 | tail -1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
el "gpu tests"
timeout 75 python -m pytest -q -x -p no:cacheprovider tests/kernels/test_norm_rope_triton.py \
    tests/kernels/test_router_triton.py tests/model/test_fuse_qkv.py > $OUT/gpu_tests.txt 2>&1
echo "rc=$?" >> $OUT/gpu_tests.txt; tail -3 $OUT/gpu_tests.txt
el "engine bench"
mkdir -p $OUT/engine
timeout 175 python -m moet.bench.engine_bench --models qwen3_30b,glm45air --budget-s 165 --out $OUT/engine \
    > $OUT/engine/log.txt 2>&1; echo "rc=$?"; grep -E "single stream|streams:|prefill|correctness|FAIL" $OUT/engine/log.txt | cut -c1-220
el "serve bench"
timeout 85 python -m moet.bench.serve_bench --requests 64 --concurrency 16 --max-tokens 64 --budget-s 70 \
    --out $OUT/serve_bench.json > $OUT/serve_log.txt 2>&1; echo "rc=$?"; tail -25 $OUT/serve_log.txt | cut -c1-200
el "residency bench"
left=$(( 560 - ($(date +%s) - t0) ))
mkdir -p $OUT/res
timeout $left python -m moet.bench.residency_bench --out $OUT/res --budget-s $(( left - 25 )) --cards 32 --boot-layers 1 \
    > $OUT/res/log.txt 2>&1; echo "rc=$?"; tail -30 $OUT/res/log.txt | cut -c1-200
el "done"
cd $OUT && tar czf run6.tgz engine res gpu_tests.txt serve_bench.json serve_log.txt 2>/dev/null; ls -la $OUT
