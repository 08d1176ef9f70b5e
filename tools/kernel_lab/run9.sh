#!/usr/bin/env bash
# Device run 9 (prepared 2026-11-29 for the next session; one call, ~7 min): kernel labs.
#   1. the grouped wgmma W2 MoE decode layer (e4m3 activations) vs moet's Triton path (issue 4)
#   2. the bf16-activation wgmma W2 GEMV vs the e4m3 one and a bf16 GEMV (issue 4)
#   3. attention_bench --quick: GQA batch 1 / 32 at 32K with and without the prefetching loop (issue 5)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
mkdir -p $OUT/moe $OUT/bf16 $OUT/attn
el "moe wgmma"
timeout 200 python3 tools/kernel_lab/ptx_w2/run_moe_wgmma.py --out $OUT/moe --budget-s 150 > $OUT/moe/log.txt 2>&1
echo "rc=$?"; tail -20 $OUT/moe/log.txt | cut -c1-200
el "bf16 wgmma"
timeout 150 python3 tools/kernel_lab/ptx_w2/run_wgmma_bf16.py --out $OUT/bf16 --budget-s 120 > $OUT/bf16/log.txt 2>&1
echo "rc=$?"; tail -20 $OUT/bf16/log.txt | cut -c1-200
el "attention"
left=$(( 540 - ($(date +%s) - t0) ))
timeout $left python -m moet.bench.attention_bench --quick --out $OUT/attn --budget-s $(( left - 20 )) > $OUT/attn/log.txt 2>&1
echo "rc=$?"; tail -14 $OUT/attn/log.txt | cut -c1-200
el "done"
cd $OUT && tar czf run9.tgz moe bf16 attn 2>/dev/null; ls
