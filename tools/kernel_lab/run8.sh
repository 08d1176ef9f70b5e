#!/usr/bin/env bash
# Device run 8 (prepared 2026-11-29 for the next session; one call, ~9.5 min, carry [".whl"]):
#   1. the grouped wgmma W2 MoE decode layer vs moet's Triton path and a bf16 GEMV (issue 4)
#   2. engine_bench after the second fusion round + a profile of one captured step (issue 6)
#   3. serve_bench: HTTP vs the Python API on moet-tiny (issue 9)
#   4. attention_bench --quick (issue 5: GQA batch 1 at 32K)
# moet-tiny full-v5 training is its own call (tools/train_tiny/README.md); residency_bench with
# --cards 32,96 and the accelerate stage is another (~9 min).
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
pyv=$(python -c "import sys; print(f\"cp{sys.version_info[0]}{sys.version_info[1]}\")")
python -m pip install -q --no-deps $(ls .whl/serve/*.whl | grep -v pydantic_core) .whl/serve/pydantic_core-*-$pyv-*.whl 2>&1 | grep -v WARNING | tail -3
python -m pip install -q --no-deps .whl/bench/*.whl 2>&1 | grep -v WARNING | tail -1
python -c "import uvicorn, fastapi, pydantic, accelerate; print('deps ok')"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
el "moe wgmma"
mkdir -p $OUT/moe
timeout 200 python3 tools/kernel_lab/ptx_w2/run_moe_wgmma.py --out $OUT/moe --budget-s 150 > $OUT/moe/log.txt 2>&1
echo "rc=$?"; tail -25 $OUT/moe/log.txt | cut -c1-200
el "engine bench"
mkdir -p $OUT/engine
timeout 170 python -m moet.bench.engine_bench --models qwen3_30b,glm45air --budget-s 160 --out $OUT/engine \
    > $OUT/engine/log.txt 2>&1; echo "rc=$?"; grep -E "single stream|streams:|prefill|FAIL" $OUT/engine/log.txt | cut -c1-200
timeout 60 python tools/kernel_lab/engine_profile.py --out $OUT/engine --model glm45air --steps 20 > /dev/null 2>&1
head -3 $OUT/engine/engine_profile_glm45air_b1.txt
el "serve bench"
timeout 90 python -m moet.bench.serve_bench --requests 64 --concurrency 16 --max-tokens 64 --budget-s 70 \
    --out $OUT/serve_bench.json > $OUT/serve_log.txt 2>&1; echo "rc=$?"; tail -8 $OUT/serve_log.txt | cut -c1-200
el "attention"
left=$(( 555 - ($(date +%s) - t0) ))
mkdir -p $OUT/attn
timeout $left python -m moet.bench.attention_bench --quick --out $OUT/attn --budget-s $(( left - 20 )) > $OUT/attn/log.txt 2>&1
echo "rc=$?"; tail -12 $OUT/attn/log.txt | cut -c1-200
el "done"
cd $OUT && gzip -f engine/*.json 2>/dev/null; tar czf run8.tgz moe engine attn serve_bench.json serve_log.txt 2>/dev/null; ls
