#!/usr/bin/env bash
# Device run 22 (prepared in stop 19 for the next session). Results in one $OUT/<mode>.tgz.
# Historical: its attn mode ran as run 22 (tools/kernel_lab/run22_h200_2026-12-01/); chains=2 was slower in
# every case and has been removed (docs/perf.md, attention "Run 22"), so attn no longer runs as is.
#   bash tools/kernel_lab/run22.sh attn    (~4 min) paged_decode_gqa(chains=2), built in stop 19 and never run
#       on a GPU: its reference checks (GPU pytest), the probe in graphs of 4 (run21b.sh), then
#       attention_bench --quick, whose rows now carry the engine-shaped "graph of 4" figure next to the
#       one-call one and whose GQA settings include chains 2 at 3 / 5 stages
#   bash tools/kernel_lab/run22.sh final   (~9 min) engine_bench GLM-4.5-Air and Qwen3-30B-A3B (run21.sh final):
#       the run-21 MoE table (T = 3-8 buckets with BM 8 / 4) end to end at 4 / 8 streams
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
R=/tmp/r22; mkdir -p $R
MODE=${1:-}
save() { tar czf $OUT/${MODE}.tgz -C $R . 2>/dev/null; }
case "$MODE" in
attn)
    bash tools/kernel_lab/run21b.sh; cp -r /tmp/r21b/. $R/ 2>/dev/null; save
    timeout -k 5 200 python -m moet.bench.attention_bench --quick --out $R/bench --budget-s 180 \
        > $R/log_bench.txt 2>&1; echo "bench rc=$?"; grep -E "best split|graph of|differs" $R/log_bench.txt | cut -c1-200
    save ;;
final)
    bash tools/kernel_lab/run21.sh final; cp -r /tmp/r21/. $R/ 2>/dev/null; save ;;
*) echo "usage: run22.sh attn|final"; exit 2 ;;
esac
