#!/usr/bin/env bash
# Device run 32 (stop 27). Results in $OUT/<mode>.tgz.
#   bash tools/kernel_lab/run32.sh chunk  (~6 min) the chunked decode (MoEConfig.chunked, moe_chunked_decode.py:
#       gate/up + SwiGLU and that chunk's down in one program, one launch, fp32 partials per chunk summed by the
#       combine): its GPU tests, then moe_config_probe.py at DeepSeek-V3 W2 T = 1 (the table: 49.3 us, run 30),
#       chunk rows / warps / stages / down rows against the table config in the same process
#   bash tools/kernel_lab/run32.sh chunk2 (~6 min) the same for DeepSeek-V3 FP4 T = 1, W2 T = 4 / 8, Qwen3 and
#       GLM-4.5-Air W2 T = 1 (fewer chunks: I 768 / 1408)
#   bash tools/kernel_lab/run32.sh stacked (~2 min) GemmConfig.stacked (gate and up rows one MMA tile): its tests, probes
#   bash tools/kernel_lab/run32.sh pf (~1.5 min) MoEConfig.down_prefetch_steps: the down's L2 prefetch, first K steps only
#   bash tools/kernel_lab/run32.sh dn (~1 min) DeepSeek-V3 T = 1 down / gate-up variants the tuner never timed (FP4: split-K,
#       BKH 64, ring depth, unrolled loops; W2 on the merged table)
# The chunk / chunk2 / stacked modes ran at commits bc49aa9 / 1c1a0f8; both forms lost (docs/perf.md, MoE "Stop 27 /
# run 32") and were removed after, so those modes no longer run on main.
#   bash tools/kernel_lab/run32.sh twohalf|ncu|prefix: run31.sh's modes (issue 5's two-half split kernel; Nsight
#       Compute on the decode GEMMs; the layer cut on every shape)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
R=/tmp/r32; mkdir -p $R
MODE=${1:-}
save() { tar czf $OUT/${MODE}.tgz -C $R . 2>/dev/null; }
C="chunked=1;gu.BKH=32;gu.num_warps=8;gu.num_stages=4;dn.BN=128;dn.num_stages=3"   # the base chunk variant
probe() {  # name, timeout, shape, fmt, tokens, variants...
    local n=$1 to=$2 sh=$3 f=$4 tk=$5; shift 5
    timeout -k 5 $to python tools/kernel_lab/moe_config_probe.py --out $R/probe_$n --shape $sh --fmt $f --tokens $tk \
        --variants "$@" > $R/log_probe_$n.txt 2>&1
    echo "probe $n rc=$?"; grep -E "^\[" $R/log_probe_$n.txt | cut -c1-190; save
}
case "$MODE" in
chunk)
    timeout -k 5 200 python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_triton.py -k "chunked or matches_reference or row_tiled" \
        > $R/pytest_chunk.txt 2>&1; echo "tests rc=$?"; tail -3 $R/pytest_chunk.txt; save
    probe w2_t1 330 deepseek w2 1 "$C;gu.BN=128" "$C;gu.BN=128;gu.num_warps=4" "$C;gu.BN=128;gu.BKH=64;gu.num_stages=3" \
        "$C;gu.BN=128;gu.chains=2" "$C;gu.BN=128;dn.BN=256" "$C;gu.BN=128;dn.BN=64;dn.num_stages=4" \
        "$C;gu.BN=128;dn.num_stages=2" "$C;gu.BN=128;dn.num_stages=5" "$C;gu.BN=256;gu.num_stages=3" \
        "$C;gu.BN=128;BM=1" "$C;gu.BN=128;BM=4" "$C;gu.BN=128;gu.num_stages=6" "$C;gu.BN=128;pdl=0;fused_combine=0"
    ;;
chunk2)
    probe fp4_t1 170 deepseek fp4 1 "$C;gu.BN=128" "$C;gu.BN=128;gu.num_warps=4" "$C;gu.BN=64;gu.num_warps=4" \
        "$C;gu.BN=128;gu.chains=2" "$C;gu.BN=128;dn.BN=64" "$C;gu.BN=256;gu.num_stages=3"
    probe w2_t48 150 deepseek w2 4,8 "$C;gu.BN=128" "$C;gu.BN=256;gu.num_stages=3" "$C;gu.BN=128;gu.num_warps=4"
    probe qwen_t1 100 qwen w2 1 "$C;gu.BN=128" "$C;gu.BN=128;gu.num_warps=4" "$C;gu.BN=128;dn.BN=64"
    probe glm_t1 100 glm w2 1 "$C;gu.BN=128" "$C;gu.BN=128;gu.num_warps=4" "$C;gu.BN=128;dn.BN=64"
    ;;
stacked)
    timeout -k 5 200 python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_triton.py -k "stacked or chunked or matches_reference" \
        > $R/pytest_stacked.txt 2>&1; echo "tests rc=$?"; tail -3 $R/pytest_stacked.txt; save
    S="gu.stacked=1;gu.BN=16"
    probe st_w2_t1 200 deepseek w2 1 "$S" "$S;gu.num_stages=3" "$S;gu.BKH=32" "$S;gu.BKH=32;gu.num_stages=6" \
        "gu.stacked=1;gu.num_warps=4" "$S;gu.chains=2" "$S;gu.num_stages=3;dn.num_warps=4" "dn.num_warps=4" \
        "$S;gu.BKH=32;BM=4" "$S;gu.num_stages=2"
    probe st_fp4_t1 120 deepseek fp4 1 "$S" "$S;gu.num_stages=3" "$S;gu.BKH=32" "gu.stacked=1;gu.num_warps=4" \
        "$S;gu.chains=1" "dn.num_warps=4"
    probe st_w2_t8 120 deepseek w2 4,8 "$S" "$S;gu.num_stages=3" "$S;gu.BKH=32" "gu.stacked=1;gu.num_warps=4"
    probe st_qwen 90 qwen w2 1,8 "$S" "$S;gu.num_stages=3" "$S;gu.BKH=32"
    ;;
pf)
    timeout -k 5 100 python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_triton.py -k "prefetch" \
        > $R/pytest_pf.txt 2>&1; echo "tests rc=$?"; tail -3 $R/pytest_pf.txt; save
    P="down_prefetch=1;down_prefetch_steps"
    probe pf_w2_t1 150 deepseek w2 1 "$P=1" "$P=2" "$P=3" "$P=4" "down_prefetch=1" "$P=2;dn.num_stages=3"
    probe pf_fp4_t1 150 deepseek fp4 1 "pdl=1" "pdl=1;$P=1" "pdl=1;$P=2" "pdl=1;$P=4" "pdl=1;fused_combine=1" \
        "pdl=1;$P=2;fused_combine=1"
    probe pf_w2_t8 100 deepseek w2 8 "pdl=1" "pdl=1;$P=1" "pdl=1;$P=2"
    probe pf_qwen 60 qwen w2 1 "$P=1" "$P=2"
    probe pf_qwen_fp4 60 qwen fp4 1 "pdl=1" "pdl=1;$P=1" "pdl=1;$P=2"
    ;;
dn)
    probe dn_fp4_t1 200 deepseek fp4 1 "dn.SPLIT_K=2" "dn.SPLIT_K=2;dn.BN=32;dn.num_warps=2" "dn.BKH=64" \
        "dn.BKH=64;dn.num_stages=3" "dn.num_stages=6" "dn.unroll=2" "dn.chains=1;dn.BN=32" "fused_combine=1" \
        "BM=8;dn.BKH=64" "gu.num_stages=5" "gu.BKH=128;gu.num_stages=3" "gu.unroll=2"
    probe dn_w2_t1 150 deepseek w2 1 "dn.BN=128" "dn.num_stages=5" "dn.BKH=64" "dn.SPLIT_K=2" "gu.num_stages=5" \
        "dn.unroll=2" "gu.unroll=2" "down_prefetch_steps=2;dn.BN=128"
    ;;
twohalf|ncu|prefix) OUT=$OUT bash tools/kernel_lab/run31.sh $MODE ;;
*) echo "usage: run32.sh pf|dn|twohalf|ncu|prefix (chunk|chunk2|stacked: at bc49aa9 / 1c1a0f8 only)"; exit 2 ;;
esac
