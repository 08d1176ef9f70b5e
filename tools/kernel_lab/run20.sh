#!/usr/bin/env bash
# Device run 20 (prepared 2026-12-01 for the next session), carry [".whl"] (.whl/serve as in run11.sh).
# Results in one $OUT/<mode>.tgz, tarred after every step.
#   bash tools/kernel_lab/run20.sh serve     (~2 min) the server after stop 18's fixes: server_start_up()
#       (the app build's collections no longer "pauses while serving"), the JIT watch's raw cache-key diff
#       for the one compile left in run 19 (`_prep_small_kernel`, same specialization); expect 0 / 0
#   bash tools/kernel_lab/run20.sh prefill   (~6 min) issue 4's prefill target (>= 50% of the bf16 GEMM at
#       T = 8192; run 4: W2 43.8%, FP4 33.8%): moe_kernel_tune with the widened prefill candidates (BN 128
#       BKH 32, 4 stages, row tiles re-swept after the token tile), DeepSeek-V3 and GLM shapes, W2 and FP4;
#       merge the returned tune/moe_configs.json with moet.bench.moe_kernel_tune.merge_table if better
#   bash tools/kernel_lab/run20.sh ncu       (~3-7 min) issue 5, batch 1: Nsight Compute on the GQA decode (if present)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
R=/tmp/r20; mkdir -p $R
MODE=${1:-}
save() { tar czf $OUT/${MODE}.tgz -C $R . 2>/dev/null; }
case "$MODE" in
serve)
    bash tools/kernel_lab/run19.sh serve
    cp -r /tmp/r19/. $R/ 2>/dev/null; save ;;
prefill)
    timeout -k 5 --signal=INT 560 python -m moet.bench.moe_kernel_tune --out $R/tune --budget-s 540 \
        --shapes deepseek,glm --formats w2,fp4 --tokens 8192 --tune deepseek:8192,glm:8192 \
        --write-table > $R/log_tune.txt 2>&1; echo "rc=$?"
    grep -E "^\[|TFLOP|failed" $R/log_tune.txt | cut -c1-220 | tail -20
    save ;;
ncu)
    # issue 5, batch 1 (32K, Qwen3 heads): why one decode program per SM reads only ~16 GB/s and why
    # 2-4 co-resident programs (64 / 128 splits) were slower still (runs 14-19). Nsight Compute if the
    # machine has it: warp stall reasons, achieved occupancy, DRAM throughput, for the launch table's
    # 32-split launch and for 64 splits (the probe's --batches 1, one kernel each)
    NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    echo "ncu: ${NCU:-none}"; nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
    if [ -n "$NCU" ]; then
        for v in base splits64; do
            # the first launch of the variant's kernel (eager, before its graph is captured)
            timeout -k 5 180 $NCU --target-processes all -k regex:_gqa_decode_split_kernel -c 1 \
                --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
                --section LaunchStats --section SchedulerStats --csv --page details \
                python tools/kernel_lab/gqa_decode_probe.py --out $R/ncu_$v --batches 1 --kv bf16 --only $v \
                > $R/ncu_$v.csv 2> $R/ncu_err_$v.txt
            echo "$v rc=$?"; grep -E "Stall|Occupancy|Throughput|Registers|Shared|Waves|Issue" $R/ncu_$v.csv | cut -c1-200 | head -40
            save
        done
    fi
    save ;;
*) echo "usage: run20.sh serve|prefill|ncu"; exit 2 ;;
esac
