#!/usr/bin/env bash
# Device run 33 (stop 28). Results in $OUT/<mode>.tgz.
#   bash tools/kernel_lab/run33.sh ab   (~8 min) the scale-branch form of moe_triton (_scale_values: the
#       decoders' kWidth 2) against the one before it (tools/kernel_lab/ab/moe_triton_base.py, HEAD before the
#       change): the GPU tests of test_moe_triton on the new form, then moe_layer_prefix.py on DeepSeek-V3 and
#       Qwen3, W2 and FP4, T = 1 and 8, alternating new / base / new / base (each form twice, same process kind)
#       (ran with the form unconditional and the old file beside it, before GemmConfig.kwidth2 made it a per-GEMM
#       choice; that copy is gone, so this mode no longer runs on main: kw2 / confirm compare both forms now)
#   bash tools/kernel_lab/run33.sh kw2  (~2 min) GemmConfig.kwidth2 per GEMM against the table config, every shape
#   bash tools/kernel_lab/run33.sh confirm (~1.5 min) kw2's winners alternated with the table config, three times each
#   bash tools/kernel_lab/run33.sh final (~5 min) the merged table: GPU tests, the layer cut on every shape
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
R=/tmp/r33; mkdir -p $R
MODE=${1:-}
save() { tar czf $OUT/${MODE}.tgz -C $R . 2>/dev/null; }
M=src/moet/kernels/moe_triton.py
case "$MODE" in
ab)
    cp $M $R/moe_triton_new.py
    timeout -k 5 170 python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_triton.py -x \
        > $R/pytest_new.txt 2>&1; echo "tests rc=$?"; tail -3 $R/pytest_new.txt; save
    for i in 1 2; do
        for form in new base; do
            cp $R/moe_triton_$form.py $M 2>/dev/null || cp tools/kernel_lab/ab/moe_triton_base.py $M
            timeout -k 5 100 python tools/kernel_lab/moe_layer_prefix.py --out $R/prefix_${form}_$i \
                --shapes deepseek,qwen --formats w2,fp4 --tokens 1,8 > $R/log_prefix_${form}_$i.txt 2>&1
            echo "prefix $form $i rc=$?"; grep -E "^\[" $R/log_prefix_${form}_$i.txt | cut -c1-150; save
        done
    done
    cp $R/moe_triton_new.py $M
    ;;
kw2)
    probe() {  # name, timeout, shape, fmt, tokens, variants...
        local n=$1 to=$2 sh=$3 f=$4 tk=$5; shift 5
        timeout -k 5 $to python tools/kernel_lab/moe_config_probe.py --out $R/probe_$n --shape $sh --fmt $f --tokens $tk \
            --variants "$@" > $R/log_probe_$n.txt 2>&1
        echo "probe $n rc=$?"; grep -E "^\[" $R/log_probe_$n.txt | cut -c1-170; save
    }
    timeout -k 5 100 python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_triton.py -k "kwidth2" \
        > $R/pytest_kw2.txt 2>&1; echo "tests rc=$?"; tail -2 $R/pytest_kw2.txt; save
    K="gu.kwidth2=1"; D="dn.kwidth2=1"
    probe ds_w2_t1 120 deepseek w2 1 "$D" "$K" "$K;$D" "$K;gu.BKH=32" "$K;gu.num_stages=3" "$D;dn.BN=32" \
        "$D;dn.num_stages=3" "$D;dn.BKH=64"
    probe ds_w2_t48 90 deepseek w2 4,8 "$D" "$K" "$K;$D"
    probe ds_fp4 90 deepseek fp4 1,8 "$D" "$K" "$K;$D"
    probe qwen_w2 90 qwen w2 1,8 "$D" "$K" "$K;$D"
    probe qwen_fp4 90 qwen fp4 1,8 "$D" "$K" "$K;$D"
    probe glm_w2 90 glm w2 1,8 "$D" "$K" "$K;$D"
    probe glm_fp4 90 glm fp4 1,8 "$D" "$K" "$K;$D"
    ;;
confirm)   # the kw2 winners, each alternated with the table config three times in one process
    probe() {
        local n=$1 to=$2 sh=$3 f=$4 tk=$5; shift 5
        timeout -k 5 $to python tools/kernel_lab/moe_config_probe.py --out $R/probe_$n --shape $sh --fmt $f --tokens $tk \
            --variants "$@" > $R/log_probe_$n.txt 2>&1
        echo "probe $n rc=$?"; grep -E "^\[" $R/log_probe_$n.txt | cut -c1-120; save
    }
    K="gu.kwidth2=1"; D="dn.kwidth2=1"; K0="gu.kwidth2=0"
    probe c_ds_t1 90 deepseek w2 1 "$D" "$K0" "$D" "$K0" "$D" "$K0"
    probe c_ds_t4 90 deepseek w2 4 "$K" "$K0" "$K" "$K0" "$K;$D" "$K0" "$K;$D"
    probe c_ds_t8 90 deepseek w2 8 "$K;$D" "$K0" "$K;$D" "$K0" "$K;$D" "$K0" "$K"
    probe c_qw_t1 90 qwen w2 1 "$D" "$K0" "$D" "$K0" "$D" "$K0"
    probe c_qw_t8 90 qwen w2 8 "$K;$D" "$K0" "$K;$D" "$K0" "$K;$D" "$K0"
    probe c_glm_t8 90 glm w2 8 "$D" "$K0" "$D" "$K0" "$D" "$K0"
    probe c_glmf_t1 90 glm fp4 1 "$K" "$K0" "$K" "$K0" "$K;$D" "$K0" "$K"
    ;;
final)   # the merged table: the GPU tests, then the layer cut on every shape at T = 1, 4, 8
    timeout -k 5 200 python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_triton.py tests/bench/test_moe_kernel_tune.py \
        > $R/pytest_final.txt 2>&1; echo "tests rc=$?"; tail -2 $R/pytest_final.txt; save
    timeout -k 5 200 python tools/kernel_lab/moe_layer_prefix.py --out $R/prefix --shapes deepseek,glm,qwen \
        --formats w2,fp4 --tokens 1,4,8 > $R/log_prefix.txt 2>&1
    echo "prefix rc=$?"; grep -E "^\[" $R/log_prefix.txt | cut -c1-150; save
    ;;
*) echo "usage: run33.sh ab|kw2|confirm|final"; exit 2 ;;
esac
