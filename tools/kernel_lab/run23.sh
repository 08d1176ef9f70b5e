#!/usr/bin/env bash
# Device run 23 (2026-12-01, stop 20). Results in one $OUT/<mode>.tgz.
#   bash tools/kernel_lab/run23.sh prefill   (~5 min) DeepSeek-V3 W2 + FP4 prefill (T = 8192) re-tuned with the
#       BKH-64 and BN-256 candidates (issue 4's >= 50% at T = 8192: 48.6% / 39.9% in run 21), table merged
#   bash tools/kernel_lab/run23.sh final     (~9 min) engine_bench GLM-4.5-Air and Qwen3-30B-A3B (run21.sh final)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
R=/tmp/r23; mkdir -p $R
MODE=${1:-}
save() { tar czf $OUT/${MODE}.tgz -C $R . 2>/dev/null; }
case "$MODE" in
prefill)
    timeout -k 5 --signal=INT 500 python -m moet.bench.moe_kernel_tune --out $R/tune --budget-s 470 \
        --shapes deepseek --formats w2,fp4 --tokens 8192 --tune deepseek:8192 \
        --write-table > $R/log_tune.txt 2>&1; echo "rc=$?"
    cp src/moet/kernels/moe_configs.json $R/moe_configs_merged.json
    grep -E "^\[|TFLOP|failed" $R/log_tune.txt | cut -c1-200 | tail -24
    save ;;
final)
    bash tools/kernel_lab/run21.sh final; cp -r /tmp/r21/. $R/ 2>/dev/null; save ;;
*) echo "usage: run23.sh prefill|final"; exit 2 ;;
esac
