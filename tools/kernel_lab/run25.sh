#!/usr/bin/env bash
# Device run 25 (2026-12-01, stop 22). Results in $OUT/<mode>.tgz.
#   bash tools/kernel_lab/run25.sh mla   (~6 min) GPU tests of the attention kernels (fp8_words now the fp8 GQA
#       default; the MLA decode's heads-as-M tile), the GQA probe's default against the byte tile (fp8) at
#       batch 1 / 8 / 32, then mla_decode_probe.py: the MLA decode's tile forms at 32K, batch 1 / 8 / 32
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
R=/tmp/r25; mkdir -p $R
MODE=${1:-}
save() { tar czf $OUT/${MODE}.tgz -C $R . 2>/dev/null; }
case "$MODE" in
mla)
    timeout -k 5 170 python -m pytest -q -p no:cacheprovider tests/kernels/test_attention_triton.py \
        tests/kernels/test_attention_cuda.py > $R/pytest_attn.txt 2>&1; echo "tests rc=$?"; tail -3 $R/pytest_attn.txt; save
    timeout -k 5 100 python tools/kernel_lab/gqa_decode_probe.py --out $R/gqa --amortize 4 --kv fp8 --only "base,bytes" \
        > $R/log_gqa.txt 2>&1; echo "gqa probe rc=$?"; grep -E "^\[" $R/log_gqa.txt | cut -c1-200; save
    timeout -k 5 200 python tools/kernel_lab/mla_decode_probe.py --out $R/mla_bf16 --kv bf16 \
        > $R/log_mla_bf16.txt 2>&1; echo "mla bf16 rc=$?"; grep -E "^\[|^b[0-9]" $R/log_mla_bf16.txt | cut -c1-200; save
    timeout -k 5 120 python tools/kernel_lab/mla_decode_probe.py --out $R/mla_fp8 --kv fp8-block \
        --only "base,hm eager,hm eager n16,hm eager s3" > $R/log_mla_fp8.txt 2>&1; echo "mla fp8 rc=$?"
    grep -E "^\[|^b[0-9]" $R/log_mla_fp8.txt | cut -c1-200; save ;;
*) echo "usage: run25.sh mla"; exit 2 ;;
esac
