#!/usr/bin/env bash
# Device run 34 (stop 30). Results in $OUT/<mode>.tgz.
#   bash tools/kernel_lab/run34.sh timeline (~3 min) issue 5, batch 1: gqa_timeline_probe.py -- the GQA decode's
#       T(n) = a + n s over loop steps at a fixed 128-program grid, per-program %globaltimer / %clock64 stamps of
#       the split and merge kernels in a graph of 4 layers, and a max_splits sweep at 32K / 128K.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
R=/tmp/r34; mkdir -p $R
MODE=${1:-}
save() { tar czf $OUT/${MODE}.tgz -C $R . 2>/dev/null; }
case "$MODE" in
timeline)
    timeout -k 5 400 python tools/kernel_lab/gqa_timeline_probe.py --out $R/timeline > $R/log_timeline.txt 2>&1
    echo "timeline rc=$?"; cut -c1-400 $R/log_timeline.txt | tail -60; save ;;
*) echo "usage: run34.sh timeline"; exit 2 ;;
esac
