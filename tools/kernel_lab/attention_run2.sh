#!/usr/bin/env bash
# Attention kernels, H200 run 2 (issue 5): the short device call after the first run's fixes.
#   1. GPU pytest of what changed: test_attention_cuda.py (KV writes byte-equal incl. fp8 block
#      scales, GQA / MLA decode + prefill at Qwen3 / DeepSeek-V3 shapes, forward_paged) and
#      test_attention_triton.py (the decode kernels compiled, fp32 exactness, bit-identical reruns).
#   2. attention_bench --quick: decode at 32K, batch 1 / 32, bf16 / fp8, GQA + MLA (a few split
#      settings), prefill 8K bf16, copy + GEMM references; stops itself before its budget.
# Whole script <= 150 s wall on a cold box (Triton compiles included): pytest is cut at 75 s and
# the bench gets what is left minus a margin. Results under $OUT.
#     OUT=/some/dir bash tools/kernel_lab/attention_run2.sh
#     bash tools/kernel_lab/attention_run2.sh --smoke     # on CPU: the same steps, interpreter, toy shapes
set -u
SMOKE=${1:-}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/attention_run2}
mkdir -p "$OUT"
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
timeout --signal=INT --kill-after=5 75 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_attention_cuda.py \
    tests/kernels/test_attention_triton.py 2>&1 | tail -40 | tee "$OUT/pytest_gpu_log.txt"
left=$((145 - $(date +%s) + t0))
echo "pytest done after $(( $(date +%s) - t0 )) s; bench budget $((left - 12)) s"
timeout --signal=INT --kill-after=5 "$left" python3 -m moet.bench.attention_bench --quick $SMOKE --out "$OUT" --budget-s $((left - 12)) \
    2>&1 | tee "$OUT/bench_log.txt"
echo "total $(( $(date +%s) - t0 )) s"
