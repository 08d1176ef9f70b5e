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
        # full set into a report, then the details page and the SASS with per-instruction stall samples
        prof() {  # name, kernel regex, launch skip, command...
            local n=$1 k=$2 s=$3; shift 3
            timeout -k 5 200 $NCU --clock-control none --target-processes all -k regex:$k -s $s -c 1 \
                --set full --import-source no -f -o $R/ncu_$n "$@" > $R/ncu_run_$n.txt 2>&1
            echo "$n rc=$?"; tail -3 $R/ncu_run_$n.txt
            $NCU -i $R/ncu_$n.ncu-rep --page details --csv > $R/ncu_$n.csv 2>&1
            $NCU -i $R/ncu_$n.ncu-rep --page source --csv --print-source sass > $R/ncu_sass_$n.csv 2>&1
            grep -E "Stall|Occupancy|Throughput|Registers|Shared Memory|Waves|Issue|Duration|Warp Cycles" \
                $R/ncu_$n.csv | cut -c1-200 | head -60
            mkdir -p /tmp/ncurep; mv -f $R/ncu_$n.ncu-rep /tmp/ncurep/ 2>/dev/null; save
        }
        for v in base splits64; do
            prof gqa_$v _gqa_decode_split_kernel 0 \
                python tools/kernel_lab/gqa_decode_probe.py --out $R/probe_$v --batches 1 --kv bf16 --only $v
        done
        prof gqa_fp8 _gqa_decode_split_kernel 0 \
            python tools/kernel_lab/gqa_decode_probe.py --out $R/probe_fp8 --batches 1 --kv fp8 --only base
        # MoE decode, DeepSeek W2 T = 1: launches of the 2nd call (skip the 1st call's: JIT-warm)
        prof moe_gu _moe_gemm_kernel 2 python tools/kernel_lab/moe_decode_once.py --shape deepseek --tokens 1
        prof moe_dn _moe_gemm_kernel 3 python tools/kernel_lab/moe_decode_once.py --shape deepseek --tokens 1
    fi
    save ;;
*) echo "usage: run20.sh serve|prefill|ncu"; exit 2 ;;
esac
