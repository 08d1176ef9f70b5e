#!/usr/bin/env bash
# Device run 24 (2026-12-01, stop 21). Results in $OUT/<mode>.tgz.
#   bash tools/kernel_lab/run24.sh swap   (~4 min) the GQA decode's transposed update (paged_decode_gqa(swap_ab=True):
#       tokens as the MMAs' M, wgmma over K / V in shared memory): GPU tests of test_attention_triton.py (both forms
#       against the reference), then gqa_decode_probe.py --amortize 4 at 32K, batch 1 / 8 / 32, bf16 + fp8,
#       against the launch table (issue 5: batch 1 bf16 at 54% of the copy, fp8 24-62%)
#   bash tools/kernel_lab/run24.sh f8w    (~3 min) fp8 caches read as int32 words (paged_decode_gqa(fp8_words=True)):
#       GPU tests, then the probe over fp8 caches at batch 1 / 8 / 32 against the byte-tile table launch
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
R=/tmp/r24; mkdir -p $R
MODE=${1:-}
save() { tar czf $OUT/${MODE}.tgz -C $R . 2>/dev/null; }
case "$MODE" in
swap)
    timeout -k 5 150 python -m pytest -q -p no:cacheprovider tests/kernels/test_attention_triton.py \
        > $R/pytest_attn.txt 2>&1; echo "tests rc=$?"; tail -3 $R/pytest_attn.txt; save
    timeout -k 5 300 python tools/kernel_lab/gqa_decode_probe.py --out $R/probe --amortize 4 \
        --only "base,splits64,swap,swap s3,swap s5,swap w8 s5,swap t128 w8 s3,swap t128 w8 s5,swap splits64 s3" \
        > $R/log_probe.txt 2>&1; echo "probe rc=$?"
    grep -E "b[0-9]+ (bf16|fp8)" $R/log_probe.txt | cut -c1-230; save ;;
f8w)
    timeout -k 5 150 python -m pytest -q -p no:cacheprovider tests/kernels/test_attention_triton.py \
        tests/kernels/test_attention_cuda.py > $R/pytest_attn_f8w.txt 2>&1; echo "tests rc=$?"; tail -3 $R/pytest_attn_f8w.txt; save
    timeout -k 5 300 python tools/kernel_lab/gqa_decode_probe.py --out $R/probe_f8w --amortize 4 --kv fp8 \
        --only "base,splits64,f8w,f8w s3,f8w s7,f8w splits64,f8w t128 s3" \
        > $R/log_probe_f8w.txt 2>&1; echo "probe rc=$?"
    grep -E "b[0-9]+ (bf16|fp8)" $R/log_probe_f8w.txt | cut -c1-230; save ;;
*) echo "usage: run24.sh swap|f8w"; exit 2 ;;
esac
