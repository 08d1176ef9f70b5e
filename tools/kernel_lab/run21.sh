#!/usr/bin/env bash
# Device run 21 (2026-12-01, stop 19). Results in one $OUT/<mode>.tgz, tarred after every step.
#   bash tools/kernel_lab/run21.sh moe       (~5 min) GPU tests of the grouped MoE kernels, then
#       tools/kernel_lab/moe_decode_probe.py: the table's decode configs with BM 1/4/8 and the K loop
#       unrolled 1/2 (run 20's Nsight Compute: the x loads of BM < 4 tiles are the decode GEMMs' top stall)
#   bash tools/kernel_lab/run21.sh prefill   (~9 min) = run20.sh prefill (issue 4's prefill target)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
R=/tmp/r21; mkdir -p $R
MODE=${1:-}
save() { tar czf $OUT/${MODE}.tgz -C $R . 2>/dev/null; }
case "$MODE" in
moe)
    el "GPU tests: grouped MoE kernels"
    timeout -k 5 150 python -m pytest -q -x tests/kernels/test_moe_triton.py > $R/pytest_moe.txt 2>&1
    echo "rc=$?"; tail -3 $R/pytest_moe.txt; save
    el "probe: deepseek T 1, 8"
    timeout -k 5 200 python tools/kernel_lab/moe_decode_probe.py --out $R/probe_ds --shapes deepseek --tokens 1,8 \
        > $R/log_probe_ds.txt 2>&1; echo "rc=$?"; grep -E "GEMV|T1 |T8 " $R/log_probe_ds.txt | cut -c1-150; save
    el "probe: glm, qwen T 1"
    timeout -k 5 170 python tools/kernel_lab/moe_decode_probe.py --out $R/probe_gq --shapes glm,qwen --tokens 1 \
        > $R/log_probe_gq.txt 2>&1; echo "rc=$?"; grep -E "GEMV|T1 " $R/log_probe_gq.txt | cut -c1-150; save
    el done ;;
prefill)
    timeout -k 5 --signal=INT 560 python -m moet.bench.moe_kernel_tune --out $R/tune --budget-s 540 \
        --shapes deepseek,glm --formats w2,fp4 --tokens 8192 --tune deepseek:8192,glm:8192 \
        --write-table > $R/log_tune.txt 2>&1; echo "rc=$?"
    grep -E "^\[|TFLOP|failed" $R/log_tune.txt | cut -c1-220 | tail -20
    save ;;
*) echo "usage: run21.sh moe|prefill"; exit 2 ;;
esac
