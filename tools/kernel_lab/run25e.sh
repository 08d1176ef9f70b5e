#!/usr/bin/env bash
# Device run 25e (2026-12-01, stop 22): the final GPU tests of the attention kernels (the new MLA
# prefill default included), the MLA decode's split count at batch 1 / 8 / 32, and GQA prefill
# launch variants at 8K. Results in $OUT/e.tgz.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
R=/tmp/r25e; mkdir -p $R
save() { tar czf $OUT/e.tgz -C $R . 2>/dev/null; }
timeout -k 5 60 python tools/kernel_lab/mla_decode_probe.py --out $R/mla --only "base,splits64,splits128" \
    > $R/log_mla.txt 2>&1; echo "mla rc=$?"; grep -E "^\[|^b[0-9]" $R/log_mla.txt | cut -c1-150; save
timeout -k 5 80 python tools/kernel_lab/gqa_decode_probe.py --out $R/gqa_prefill --prefill 8192 \
    > $R/log_gqa_prefill.txt 2>&1; echo "gqa prefill rc=$?"; grep -E "prefill" $R/log_gqa_prefill.txt | cut -c1-180; save
timeout -k 5 200 python -m pytest -q -p no:cacheprovider tests/kernels/test_attention_triton.py \
    tests/kernels/test_attention_cuda.py tests/kernels/test_mla_prefill_triton.py tests/kernels/test_prefill_triton.py \
    > $R/pytest_attn.txt 2>&1; echo "tests rc=$?"; tail -3 $R/pytest_attn.txt; save
