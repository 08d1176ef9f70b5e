#!/usr/bin/env bash
# Device run 21b (2026-12-01, stop 19, the session's last ~4 device minutes): paged_decode_gqa(chains=2)
# on the GPU: its interpreter-tested reference checks, then the probe (graphs of 4) against the table launch.
# Historical: run 22 ran it (tools/kernel_lab/run22_h200_2026-12-01/); chains=2 was slower in every case
# and has been removed (docs/perf.md, attention "Run 22"), so the chains parts no longer run as is.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
R=/tmp/r21b; mkdir -p $R
timeout -k 5 60 python -m pytest -q -p no:cacheprovider tests/kernels/test_attention_triton.py -k "loop_steps and chains-2" \
    > $R/pytest_chains.txt 2>&1; echo "tests rc=$?"; tail -1 $R/pytest_chains.txt
tar czf $OUT/r21b.tgz -C $R .
timeout -k 5 110 python tools/kernel_lab/gqa_decode_probe.py --out $R/probe --amortize 4 \
    --only base,splits64,chains2_s3,chains2_s5,chains2_s7,chains2_s3_sp64 --batches 1,8,32 > $R/log_probe.txt 2>&1; echo "probe rc=$?"
grep -E "^\[|\|" $R/log_probe.txt | cut -c1-200
tar czf $OUT/r21b.tgz -C $R .
