#!/usr/bin/env bash
# Device run 8 (prepared 2026-11-29 for the next session; one call, ~9.5 min, carry [".whl"]):
#   1. engine_bench after the second fusion round + a profile of one captured GLM step (issue 6)
#   2. serve_bench: HTTP vs the Python API on moet-tiny (issue 9)
#   3. residency_bench: 32 and 96 GB cards + transformers/accelerate offloading side by side (issue 7)
# Kernel labs are run9.sh; moet-tiny full-v5 training is its own call (tools/train_tiny/README.md).
# Wheels into their own folder on PYTHONPATH (the device README's way): the venv's site-packages
# is not ours to write, and run 7's `pip install` into it never reached the venv's python.
python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/serve/*.whl 2>&1 | grep -v WARNING | tail -3
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
python -c "import uvicorn, fastapi, pydantic, accelerate; print('deps ok')"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
el "gpu tests of the fused small ops"
timeout 90 python -m pytest -q -p no:cacheprovider tests/kernels/test_fused_small_ops.py \
    tests/kernels/test_norm_rope_triton.py tests/kernels/test_router_triton.py tests/model/test_fuse_qkv.py \
    > $OUT/gpu_tests.txt 2>&1; echo "rc=$?" >> $OUT/gpu_tests.txt; tail -2 $OUT/gpu_tests.txt
el "engine bench"
mkdir -p $OUT/engine
timeout 170 python -m moet.bench.engine_bench --models qwen3_30b,glm45air --budget-s 160 --out $OUT/engine \
    > $OUT/engine/log.txt 2>&1; echo "rc=$?"; grep -E "single stream|streams:|prefill|FAIL" $OUT/engine/log.txt | cut -c1-200
timeout 60 python tools/kernel_lab/engine_profile.py --out $OUT/engine --model glm45air --steps 20 > /dev/null 2>&1
head -1 $OUT/engine/engine_profile_glm45air_b1.txt
el "serve bench"
timeout 90 python -m moet.bench.serve_bench --requests 64 --concurrency 16 --max-tokens 64 --budget-s 70 \
    --out $OUT/serve_bench.json > $OUT/serve_log.txt 2>&1; echo "rc=$?"; tail -8 $OUT/serve_log.txt | cut -c1-200
el "residency bench"
left=$(( 560 - ($(date +%s) - t0) ))
mkdir -p $OUT/res
timeout $left python -m moet.bench.residency_bench --out $OUT/res --budget-s $(( left - 25 )) --cards 96,32 \
    --boot-layers 1 > $OUT/res/log.txt 2>&1; echo "rc=$?"; tail -30 $OUT/res/log.txt | cut -c1-200
el "done"
cd $OUT && gzip -f engine/*.json 2>/dev/null; tar czf run8.tgz engine res gpu_tests.txt serve_bench.json serve_log.txt 2>/dev/null; ls
