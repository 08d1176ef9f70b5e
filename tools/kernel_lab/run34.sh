#!/usr/bin/env bash
# Device run 34 (stop 30). Results in $OUT/<mode>.tgz.
#   bash tools/kernel_lab/run34.sh timeline (~3 min) issue 5, batch 1: gqa_timeline_probe.py -- the GQA decode's
#       T(n) = a + n s over loop steps at a fixed 128-program grid, per-program %globaltimer / %clock64 stamps of
#       the split and merge kernels in a graph of 4 layers, and a max_splits sweep at 32K / 128K.
#   bash tools/kernel_lab/run34.sh pf (~5 min) what the timeline led to: the GPU tests of the attention kernels (the L2
#       prefetch before the PDL wait, the merge's lens-independent loads), the MoE down prefetch (its helper moved to
#       pdl.py), then gqa_timeline_probe.py --skip-curve: the old / new merge in the stamped graph and the PDL /
#       prefetch_steps sweep at batch 1 (2K-128K), 8 and 32 (32K).
#   bash tools/kernel_lab/run34.sh bench (~9 min) the GPU attention tests, then the full attention_bench as the engine
#       launches (small-kernel PDL on: the prefetch where the grid fits the SMs).
#   bash tools/kernel_lab/run34.sh splits (~4 min) max_splits 32 / 48 / 64 under PDL for fp8 and bf16 caches at batch
#       1 / 4 / 8 / 32: whether a KV format's fixed split cap can follow run 34's batch-1 sweep (fp8 +18% at 32K).
#   bash tools/kernel_lab/run34.sh long (~5 min) the long partition (long_splits 64 past 32K: "s0"; ran at cf34ac9, where
#       it was the default; the default is off since, and s0 passes long_splits=64)
#       against 32 splits ("s32"), batch 1 / 8 / 32 at 8K-128K, after the GPU attention tests.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
R=/tmp/r34; mkdir -p $R
MODE=${1:-}
save() { tar czf $OUT/${MODE}.tgz -C $R . 2>/dev/null; }
case "$MODE" in
timeline)
    timeout -k 5 400 python tools/kernel_lab/gqa_timeline_probe.py --out $R/timeline > $R/log_timeline.txt 2>&1
    echo "timeline rc=$?"; cut -c1-400 $R/log_timeline.txt | tail -60; save ;;
pf)
    timeout -k 5 200 python -m pytest -q -p no:cacheprovider tests/kernels/test_attention_cuda.py \
        tests/kernels/test_attention_triton.py tests/kernels/test_pdl.py > $R/pytest_attn.txt 2>&1
    echo "attn tests rc=$?"; tail -4 $R/pytest_attn.txt; save
    timeout -k 5 150 python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_triton.py -k "prefetch" \
        > $R/pytest_moe.txt 2>&1; echo "moe tests rc=$?"; tail -2 $R/pytest_moe.txt; save
    timeout -k 5 300 python tools/kernel_lab/gqa_timeline_probe.py --out $R/pf --skip-curve > $R/log_pf.txt 2>&1
    echo "pf rc=$?"; cut -c1-400 $R/log_pf.txt | tail -30; save ;;
bench)
    [ -n "$NOTEST" ] || timeout -k 5 150 python -m pytest -q -p no:cacheprovider tests/kernels/test_attention_cuda.py -x \
        > $R/pytest_attn.txt 2>&1; echo "attn tests rc=$?"; tail -3 $R/pytest_attn.txt; save
    timeout -k 5 470 python -m moet.bench.attention_bench --out $R/bench --budget-s ${BUDGET:-380} > $R/log_bench.txt 2>&1
    echo "bench rc=$?"; grep -E "^\|" $R/log_bench.txt | tail -40; save ;;
splits)
    timeout -k 5 400 python tools/kernel_lab/gqa_timeline_probe.py --out $R/splits --skip-curve --merge-ab "" \
        --prefetch d --pdl-splits 32,48,64 --no-pdl-off --kv fp8,bf16 \
        --pdl 1:8192,1:32768,1:131072,4:32768,8:32768,8:131072,32:8192,32:32768 > $R/log_splits.txt 2>&1
    echo "splits rc=$?"; cut -c1-500 $R/log_splits.txt | tail -20; save ;;
long)
    timeout -k 5 200 python -m pytest -q -p no:cacheprovider tests/kernels/test_attention_cuda.py \
        tests/kernels/test_attention_triton.py -x > $R/pytest_attn.txt 2>&1
    echo "attn tests rc=$?"; tail -3 $R/pytest_attn.txt; save
    timeout -k 5 300 python tools/kernel_lab/gqa_timeline_probe.py --out $R/long --skip-curve --merge-ab "" \
        --prefetch d --pdl-splits 0,32 --no-pdl-off --kv fp8,bf16 \
        --pdl 1:8192,1:32768,1:65536,1:131072,8:65536,8:131072,32:65536,32:131072 > $R/log_long.txt 2>&1
    echo "long rc=$?"; cut -c1-500 $R/log_long.txt | tail -20; save ;;
*) echo "usage: run34.sh timeline|pf|bench|splits|long"; exit 2 ;;
esac
