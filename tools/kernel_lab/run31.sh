#!/usr/bin/env bash
# Device run 31 (prepared in stop 26 for the next session). Results in $OUT/<mode>.tgz.
#   bash tools/kernel_lab/run31.sh ncu (~4 min) Nsight Compute on the decode kernels as the tables now
#       launch them. run 20's profiles predate them: the MoE T = 1 table was BM 1 / split 2 then, BM 8 /
#       unsplit BKH 64 gate/up and a BN-64 down now. The cuts:
#       - run 30 (moe_layer_prefix.py): the DeepSeek-V3 W2 T = 1 gate/up streams at 2.4 TB/s and the
#         down at 1.8; the profiles say whether issue stalls or memory waits set those rates;
#       - run 20, the GQA decode at batch 1: one warp a scheduler, 21% issue, 4.2 cycles an instruction.
#       Kernels profiled: the MoE gate/up and down (moe_decode_once.py, the 2nd call's launches), and the
#       GQA decode split kernel at batch 1, 32K, bf16.
#   bash tools/kernel_lab/run31.sh twohalf (~2 min) issue 5, batch 1: the lab split kernel gqa_two_half.py, each split
#       walked as two independent halves by the two 4-warp halves of an 8-warp program (the halves stacked
#       along the dots' M / N, cross-half scores masked). Its GPU check against the reference, then 32K at batch
#       1 / 8 / 32 against paged_decode_gqa, at 3 / 5 / 7 stages (1 / 2 / 3 K-V buffers). sm_90 AOT, stacked at
#       8 warps: 156-209 registers, no spills (the batched-dot form: 255 registers with spills, because Triton
#       puts every warp on the batch dimension)
#   bash tools/kernel_lab/run31.sh prefix (~1 min) moe_layer_prefix.py on the merged tables, every shape (run 30
#       cut only DeepSeek-V3 W2 / FP4 on the run-29 tables; its Qwen3 rows failed on a down_prefetch entry,
#       fixed since)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
R=/tmp/r31; mkdir -p $R
MODE=${1:-}
save() { tar czf $OUT/${MODE}.tgz -C $R . 2>/dev/null; }
case "$MODE" in
ncu)
    NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    echo "ncu: ${NCU:-none}"
    if [ -n "$NCU" ]; then
        prof() {  # name, kernel regex, launch skip, command...
            local n=$1 k=$2 s=$3; shift 3
            timeout -k 5 200 $NCU --clock-control none --target-processes all -k regex:$k -s $s -c 1 \
                --set full --import-source no -f -o $R/ncu_$n "$@" > $R/ncu_run_$n.txt 2>&1
            echo "$n rc=$?"; tail -2 $R/ncu_run_$n.txt
            $NCU -i $R/ncu_$n.ncu-rep --page details --csv > $R/ncu_$n.csv 2>&1
            $NCU -i $R/ncu_$n.ncu-rep --page source --csv --print-source sass > $R/ncu_sass_$n.csv 2>&1
            grep -E "Duration|DRAM Throughput|Issue Slots|Warp Cycles Per Issued|Active Warps Per Scheduler|Achieved Occupancy" \
                $R/ncu_$n.csv | cut -c1-200 | head -12
            rm -f $R/ncu_$n.ncu-rep; save
        }
        prof moe_gu _moe_gemm_kernel 2 python tools/kernel_lab/moe_decode_once.py --shape deepseek --tokens 1
        prof moe_dn _moe_gemm_kernel 3 python tools/kernel_lab/moe_decode_once.py --shape deepseek --tokens 1
        prof gqa_b1 _gqa_decode_split_kernel 0 \
            python tools/kernel_lab/gqa_decode_probe.py --out $R/probe --batches 1 --kv bf16 --only base
    fi
    save ;;
prefix)
    timeout -k 5 150 python tools/kernel_lab/moe_layer_prefix.py --out $R/prefix --shapes deepseek,glm,qwen \
        > $R/log_prefix.txt 2>&1; echo "prefix rc=$?"; grep -E "^\[" $R/log_prefix.txt | cut -c1-220
    save ;;
twohalf)
    timeout -k 5 150 python tools/kernel_lab/gqa_two_half.py --check --bench --out $R/twohalf > $R/log_twohalf.txt 2>&1
    echo "twohalf rc=$?"; cat $R/log_twohalf.txt | cut -c1-160 | tail -30
    save ;;
*) echo "usage: run31.sh ncu|twohalf|prefix"; exit 2 ;;
esac
