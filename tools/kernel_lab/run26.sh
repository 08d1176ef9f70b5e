#!/usr/bin/env bash
# Device run 26 (prepared in stop 22 for the next session). Results in $OUT/<mode>.tgz.
#   bash tools/kernel_lab/run26.sh bench   (~8 min) the full attention_bench (checks, 1K / 8K / 32K / 128K, batch
#       1 and 32) with run 25's defaults (GQA fp8_words, the MLA heads-as-M 64-token decode and prefill)
#   bash tools/kernel_lab/run26.sh prefill (~2 min) GQA prefill launch variants at 8K (run 25e: 256 rows +11.5%,
#       128 keys +4%; their combination and shallower pipelines)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
R=/tmp/r26; mkdir -p $R
MODE=${1:-}
save() { tar czf $OUT/${MODE}.tgz -C $R . 2>/dev/null; }
case "$MODE" in
bench)
    timeout -k 5 540 python -m moet.bench.attention_bench --out $R/bench --budget-s 480 \
        > $R/log_bench.txt 2>&1; echo "bench rc=$?"; tail -45 $R/bench/attention_bench.md 2>/dev/null | cut -c1-220; save ;;
prefill)
    timeout -k 5 150 python tools/kernel_lab/gqa_decode_probe.py --out $R/gqa_prefill --prefill 8192 \
        > $R/log_gqa_prefill.txt 2>&1; echo "rc=$?"; grep -E "prefill" $R/log_gqa_prefill.txt | cut -c1-180; save ;;
*) echo "usage: run26.sh bench|prefill"; exit 2 ;;
esac
