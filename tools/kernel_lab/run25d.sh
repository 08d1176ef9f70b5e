#!/usr/bin/env bash
# Device run 25d (2026-12-01, stop 22): the MLA prefill's rows-as-M tile (paged_prefill_mla(heads_m=True)).
# GPU tests of the MLA prefill / decode files, then mla_decode_probe.py --prefill 8192 (bf16, fp8-block).
# Results in $OUT/prefill.tgz.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
R=/tmp/r25d; mkdir -p $R
save() { tar czf $OUT/prefill.tgz -C $R . 2>/dev/null; }
timeout -k 5 150 python -m pytest -q -p no:cacheprovider tests/kernels/test_mla_prefill_triton.py \
    tests/kernels/test_attention_triton.py -k "mla" > $R/pytest_mla.txt 2>&1; echo "tests rc=$?"; tail -3 $R/pytest_mla.txt; save
timeout -k 5 250 python tools/kernel_lab/mla_decode_probe.py --out $R/prefill --batches "" --prefill 8192 \
    > $R/log_prefill.txt 2>&1; echo "prefill rc=$?"; grep -E "prefill" $R/log_prefill.txt | cut -c1-200; save
