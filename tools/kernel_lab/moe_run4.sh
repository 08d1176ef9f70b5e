#!/usr/bin/env bash
# Expert kernels, H200 run 4 (issue 4): decode token tiles of 1-16 pairs (BM) and split-K /
# narrow-row candidates, tuned for the decode buckets; then the side-by-side bench in a fresh
# process (it reads the table this run wrote) and the GPU tests of the MoE kernels.
#     OUT=/some/dir bash tools/kernel_lab/moe_run4.sh
set -u
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/moe_run4}
mkdir -p "$OUT"
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
timeout --signal=INT 345 python3 -m moet.bench.moe_kernel_tune --out "$OUT" --budget-s 300 --shapes deepseek,glm,qwen \
    --formats w2,fp4 --tokens 1,4,8,16,32 --tune deepseek:1,deepseek:8,deepseek:32,glm:1,qwen:1 --write-table \
    2>&1 | tee "$OUT/tune_log.txt"
cp src/moet/kernels/moe_configs.json "$OUT/moe_configs_merged.json"
echo "tune done after $(( $(date +%s) - t0 )) s"
timeout --signal=INT 90 python3 -m moet.bench.moe_bench --models dsv3 --decode 1,8,32 --prefill 512 --budget-s 75 \
    --out "$OUT" 2>&1 | tail -40 | tee "$OUT/bench_log.txt"
echo "bench done after $(( $(date +%s) - t0 )) s"
timeout --signal=INT 80 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_triton.py 2>&1 | tail -15 \
    | tee "$OUT/pytest_gpu_log.txt"
echo "total $(( $(date +%s) - t0 )) s"
