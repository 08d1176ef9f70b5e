#!/usr/bin/env bash
# Device run 25b (2026-12-01, stop 22): the MLA decode's 64-token heads-as-M tile and the fp8_ds_mla
# group dots (paged_decode_mla(group_dots=True)). GPU tests of test_attention_triton.py, then
# mla_decode_probe.py at 32K, batch 1 / 8 / 32. Results in $OUT/mla2.tgz.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
R=/tmp/r25b; mkdir -p $R
save() { tar czf $OUT/mla2.tgz -C $R . 2>/dev/null; }
timeout -k 5 150 python -m pytest -q -p no:cacheprovider tests/kernels/test_attention_triton.py \
    > $R/pytest_attn.txt 2>&1; echo "tests rc=$?"; tail -3 $R/pytest_attn.txt; save
timeout -k 5 150 python tools/kernel_lab/mla_decode_probe.py --out $R/mla_bf16 --kv bf16 \
    --only "base,hm eager,hm eager n64,hm n64,base n64,base n64 eager" > $R/log_mla_bf16.txt 2>&1
echo "mla bf16 rc=$?"; grep -E "^\[|^b[0-9]" $R/log_mla_bf16.txt | cut -c1-200; save
timeout -k 5 200 python tools/kernel_lab/mla_decode_probe.py --out $R/mla_fp8 --kv fp8-block \
    --only "base,g4,hm g4,hm g4 n64,base n64 eager,hm eager n64" > $R/log_mla_fp8.txt 2>&1
echo "mla fp8 rc=$?"; grep -E "^\[|^b[0-9]" $R/log_mla_fp8.txt | cut -c1-200; save
