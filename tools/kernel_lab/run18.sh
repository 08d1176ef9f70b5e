#!/usr/bin/env bash
# Device run 18 (prepared 2026-12-01 for the next session), carry [".whl"] (.whl/serve as in run11.sh).
# Results in one $OUT/<mode>.tgz (the device returns at most 8 files).
#   bash tools/kernel_lab/run18.sh pdl     (~5 min) issue 6: EngineConfig.small_kernel_pdl (never run on a GPU):
#       its GPU tests (bit-identical engine outputs on / off, eager and graphs), then engine_bench GLM-4.5-Air
#       1 / 8 / 32 streams and Qwen3 1 / 32 with and without --small-kernel-pdl in the same call, and the
#       GLM batch-1 async profile with it on (GPU timeline: the idle between kernels it should shrink).
#       If faster and bit-identical: make small_kernel_pdl default True (config.py, test_pdl.py).
#       Then GLM single stream with --small-kernel-pdl --attention-fused-merge (GPU tests:
#       tests/engine/test_attention_fused_merge_cuda.py). Also new since run 17, measured by the same engine runs: the softmax routers' decode GEMV in Triton
#       (bf16 out; Qwen3 had cuBLAS's), compile_warmup (off in engine_bench, on in the server).
#   bash tools/kernel_lab/run18.sh attn    (~3 min) issue 5: attention_bench --quick with the fused split merge
#       (paged_decode_gqa(fused_merge=True): no merge launch; never run on a GPU): its speed, and whether its
#       bits equal the two-launch decode's (the record's same_output_as_first_of_partition; if they do not,
#       the engine may only use it fixed per model, like the split count)
#   bash tools/kernel_lab/run18.sh tune    (~6 min) issue 4: MoEConfig.fused_finish (the split gate/up's SwiGLU finish
#       in its last programs) and .fused_combine (the top-k combine in the down GEMM's last programs): one launch
#       fewer a layer each; never run on a GPU): their GPU tests, then moe_kernel_tune at
#       T = 1 / 2 (the tuner tries it on the best split config, keeps it when >= 2% faster and correct, writes the
#       table: merge the returned tune/moe_configs.json locally with moe_kernel_tune.merge_table), then
#       engine_bench GLM-4.5-Air and Qwen3 single stream / 32 streams with the new table
#   bash tools/kernel_lab/run18.sh serve   (~4 min) issue 9 follow-up: serve_bench http,python,http_process with
#       async scheduling on (run 17's engine-process phase failed on the AsyncDecode reference cycle, fixed).
python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/serve/*.whl 2>&1 | grep -v WARNING | tail -3
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
R=/tmp/r18; mkdir -p $R/engine
# tar after every step: a call killed at its time limit still returns what it measured
save() { tar czf $OUT/${MODE}.tgz -C $R . 2>/dev/null; }
MODE=${1:-}
# engine_bench MODEL STREAMS with the step's small kernels under PDL off, then on (tags plain /
# small-kernel-pdl; run 18 ran it when off was engine_bench's default, the flags now say it)
engine_ab() {
    local m=$1 st=$2 flag tag
    for flag in "--no-small-kernel-pdl" "--small-kernel-pdl"; do
        tag=small-kernel-pdl; [ $flag = --no-small-kernel-pdl ] && tag=plain
        el "engine $m $tag"
        timeout -k 5 150 python -m moet.bench.engine_bench --models $m --streams $st --prefill 0 $flag \
            --budget-s 140 --out $R/engine/${m}_$tag > $R/engine/log_${m}_$tag.txt 2>&1
        echo "rc=$?"; grep -E "single stream|streams:|FAIL|rror|budget" $R/engine/log_${m}_$tag.txt | cut -c1-200
        save
    done
}
case "${1:-}" in
pdl)
    # engine_bench needs >= 120 s of --budget-s left to start a model (its budget guard)
    if [ "${2:-}" != notests ]; then
    timeout -k 5 150 python -m pytest -q -p no:cacheprovider tests/kernels/test_pdl.py tests/model/test_shared_expert_overlap.py \
        tests/kernels/test_norm_rope_triton.py tests/kernels/test_router_triton.py tests/kernels/test_kv_write_triton.py \
        > $R/gpu_tests.txt 2>&1
    rc=$?; echo "gpu tests rc=$rc"; grep -E "FAILED|passed|failed" $R/gpu_tests.txt | tail -6
    if [ $rc -ne 0 ]; then tar czf $OUT/pdl.tgz -C $R .; exit 1; fi
    timeout -k 5 100 python -m pytest -q -p no:cacheprovider tests/engine/test_attention_fused_merge_cuda.py \
        tests/kernels/test_attention_triton.py > $R/gpu_tests_fm.txt 2>&1
    fm_rc=$?; echo "fused-merge gpu tests rc=$fm_rc"; grep -E "FAILED|passed|failed" $R/gpu_tests_fm.txt | tail -4
    el "router GEMV: fp32 (sigmoid) and bf16 (softmax, new in the engine for Qwen3 / Mixtral decode)"
    timeout -k 5 60 python tools/kernel_lab/router_bench.py --out $R 2>&1 | cut -c1-400
    fi
    save
    engine_ab glm45air 1,8,32
    el "done" ;;
pdl2)
    # the second half of the pdl measurements (one call cannot hold both within 600 s)
    fm_rc=0
    engine_ab qwen3_30b 1,32
    el "engine glm45air 1 stream, pdl + attention fused merge"
    [ $fm_rc -eq 0 ] && timeout -k 5 140 python -m moet.bench.engine_bench --models glm45air --streams 1 --prefill 0 --small-kernel-pdl \
        --attention-fused-merge --budget-s 130 --out $R/engine/glm45air_pdl_fm > $R/engine/log_glm45air_pdl_fm.txt 2>&1
    echo "rc=$?"; grep -E "single stream|FAIL|rror" $R/engine/log_glm45air_pdl_fm.txt | cut -c1-200
    el "profile glm45air batch 1, async, small-kernel pdl"
    timeout -k 5 80 python tools/kernel_lab/engine_profile.py --out $R/engine --model glm45air --batch 1 --steps 10 \
        --small-kernel-pdl > /dev/null 2>&1; head -1 $R/engine/engine_profile_glm45air_b1.txt
    grep -A2 "GPU timeline" $R/engine/engine_profile_glm45air_b1.txt | cut -c1-200
    rm -f $R/engine/engine_trace_*.json
    el "done" ;;
tune)
    mkdir -p $R/tune
    timeout -k 5 150 python -m pytest -q -p no:cacheprovider tests/kernels/test_moe_triton.py > $R/tune/gpu_tests.txt 2>&1
    rc=$?; echo "moe gpu tests rc=$rc"; grep -E "FAILED|passed|failed" $R/tune/gpu_tests.txt | tail -4
    if [ $rc -ne 0 ]; then tar czf $OUT/tune.tgz -C $R .; exit 1; fi
    timeout -k 5 --signal=INT 210 python -m moet.bench.moe_kernel_tune --out $R/tune --budget-s 190 \
        --shapes glm,qwen,deepseek --formats w2 --tokens 1,2 --tune glm:1,qwen:1,deepseek:1,glm:2 \
        --write-table > $R/tune/log.txt 2>&1; echo "rc=$?"
    save
    grep -E "^\[|fused finish|fused combine|merged" $R/tune/log.txt | cut -c1-220 | tail -20
    for m in glm45air; do
        el "engine $m"
        timeout -k 5 140 python -m moet.bench.engine_bench --models $m --streams 1,32 --prefill 0 --budget-s 130 \
            --out $R/tune/engine_$m > $R/tune/log_engine_$m.txt 2>&1
        echo "rc=$?"; grep -E "single stream|streams:|FAIL|rror" $R/tune/log_engine_$m.txt | cut -c1-200
    done ;;
attn)
    mkdir -p $R/attn
    timeout -k 5 60 python -m pytest -q -p no:cacheprovider tests/kernels/test_attention_triton.py -k fused_merge \
        > $R/attn/gpu_tests.txt 2>&1; echo "fused-merge gpu tests rc=$?"; tail -1 $R/attn/gpu_tests.txt
    timeout -k 5 170 python -m moet.bench.attention_bench --quick --out $R/attn --budget-s 150 \
        > $R/attn/log.txt 2>&1; echo "rc=$?"; grep -A12 "GQA decode GB/s per setting" $R/attn/log.txt | cut -c1-200
    grep -E "differs" $R/attn/log.txt | head -5 ;;
serve)
    mkdir -p $R/serve
    timeout -k 5 300 python -m moet.bench.serve_bench --phases http,python,http_process --requests 64 --concurrency 16 \
        --max-tokens 64 --budget-s 280 --out $R/serve/serve_bench.json > $R/serve/log.txt 2>&1
    echo "rc=$?"; grep -E "^\[(python|http|http_process)\] \{|correct|rror" $R/serve/log.txt | cut -c1-300 ;;
*) echo "usage: run18.sh pdl|pdl2|tune|attn|serve"; exit 2 ;;
esac
tar czf $OUT/${1}.tgz -C $R .
