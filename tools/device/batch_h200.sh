#!/usr/bin/env bash
# One device call, several measurements: each step has its own time limit so the call ends on
# time; results are re-packed into $OUT/results.tgz after every step (the device tool returns
# at most 8 files, so everything travels as one archive plus the combined log).
# Usage (repo root, on the GPU box): bash tools/device/batch_h200.sh
set -u
export PYTHONPATH=$PWD/src:$PWD PYTHONUNBUFFERED=1
RES=/tmp/res; mkdir -p $RES
step() {  # step NAME SECONDS CMD...
    local name=$1 secs=$2; shift 2
    echo "=== $name (limit ${secs}s) $(date -u +%T)"
    mkdir -p $RES/$name
    timeout --signal=INT --kill-after=10 $secs "$@" > $RES/$name/log.txt 2>&1
    echo "=== $name rc=$? $(date -u +%T)"; tail -n 25 $RES/$name/log.txt
    tar czf $OUT/results.tgz -C $RES .
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv > $RES/gpu.txt 2>&1
step pytest_gpu 80 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_moe_triton.py \
    tests/kernels/test_attention_cuda.py tests/kernels/test_kv_write_triton.py tests/kernels/test_mla_prefill_triton.py \
    tests/kernels/test_fp8_gemm_triton.py tests/model/test_forward_paged.py
step attention 150 python3 -m moet.bench.attention_bench --out $RES/attention --budget-s 120
step moe 80 python3 -m moet.bench.moe_bench --out $RES/moe --models dsv3 --decode 1,8,32 --prefill 8192 --budget-s 60
step fp8 55 python3 -m moet.bench.fp8_gemm_bench --out $RES/fp8 --tokens 1,128,8192 --budget-s 35
