#!/usr/bin/env bash
# Expert + attention kernels, H200 run 4 (issues 4 and 5), one device call of TOTAL seconds:
#   1. MoE decode tuning: token tiles of 1-16 pairs (BM), split-K / narrow-row candidates, PDL
#      launches timed and checked; --write-table merges the winners into the repo's table.
#   2. moe_bench side by side (transformers loop, torch._grouped_mm) in a fresh process, so it
#      reads the table step 1 wrote; its checks run the new configs at real shapes.
#   3. attention_bench --quick: GQA decode with multi-page loop steps (tile 16/32/64 tokens).
# Each step packs its files into one tarball as it ends (the device returns at most 8 files,
# and a call cut short still returns what is there).
#     OUT=/some/dir TOTAL=500 bash tools/kernel_lab/moe_run4.sh
set -u
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/moe_run4}
TOTAL=${TOTAL:-540}
mkdir -p "$OUT/tune" "$OUT/bench" "$OUT/attn"
t0=$(date +%s)
pack() { (cd "$OUT" && tar czf "$1.tgz" "$1" && rm -rf "$1"); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
tb=$(( TOTAL * 45 / 100 ))
timeout --signal=INT $((tb + 30)) python3 -m moet.bench.moe_kernel_tune --out "$OUT/tune" --budget-s $tb \
    --shapes deepseek,glm,qwen --formats w2,fp4 --tokens 1,4,8,16,32 \
    --tune deepseek:1,deepseek:8,deepseek:32,glm:1,qwen:1 --write-table > "$OUT/tune/tune_log.txt" 2>&1
tail -5 "$OUT/tune/tune_log.txt"
cp src/moet/kernels/moe_configs.json "$OUT/tune/moe_configs_merged.json"
pack tune
echo "tune done after $(( $(date +%s) - t0 )) s"
timeout --signal=INT 95 python3 -m moet.bench.moe_bench --models dsv3 --decode 1,8,32 --prefill 512 --budget-s 80 \
    --out "$OUT/bench" > "$OUT/bench/moe_bench_log.txt" 2>&1
tail -25 "$OUT/bench/moe_bench_log.txt"
pack bench
echo "moe bench done after $(( $(date +%s) - t0 )) s"
left=$((TOTAL - 10 - $(date +%s) + t0))
if [ "$left" -gt 60 ]; then
    timeout --signal=INT "$left" python3 -m moet.bench.attention_bench --quick --out "$OUT/attn" \
        --budget-s $((left - 15)) > "$OUT/attn/attention_log.txt" 2>&1
    grep -E "best split|prefill|GEMM|copy" "$OUT/attn/attention_log.txt" | tail -20
fi
pack attn
ls -la "$OUT"
echo "total $(( $(date +%s) - t0 )) s"
