#!/usr/bin/env bash
# Device run 25c (2026-12-01, stop 22): the new defaults (GQA fp8_words, the MLA decode's heads-as-M
# 64-token form) through the GPU tests, attention_bench --quick (issue 5's table) and the MLA probe's
# default against the old forms. Results in $OUT/final.tgz.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
R=/tmp/r25c; mkdir -p $R
save() { tar czf $OUT/final.tgz -C $R . 2>/dev/null; }
timeout -k 5 200 python -m pytest -q -p no:cacheprovider tests/kernels/test_attention_triton.py \
    tests/kernels/test_attention_cuda.py > $R/pytest_attn.txt 2>&1; echo "tests rc=$?"; tail -3 $R/pytest_attn.txt; save
timeout -k 5 100 python tools/kernel_lab/mla_decode_probe.py --out $R/mla --only "base,t32 lazy,t32 eager" \
    > $R/log_mla.txt 2>&1; echo "mla rc=$?"; grep -E "^\[|^b[0-9]" $R/log_mla.txt | cut -c1-160; save
timeout -k 5 230 python -m moet.bench.attention_bench --quick --out $R/bench --budget-s 200 \
    > $R/log_bench.txt 2>&1; echo "bench rc=$?"; tail -40 $R/bench/attention_bench.md 2>/dev/null | cut -c1-220; save
