#!/usr/bin/env bash
# The test suite on a CUDA machine (docs/testing.md).
#
#   scripts/gpu_tests.sh wheels
#       here, with pip and a registry: the serving packages (fastapi, starlette, uvicorn, pydantic,
#       openai and what they need; import-linter for the import-contract tests) as wheels for CPython
#       3.12 x86_64 in .whl/serve, at the versions
#       installed on this machine; for a GPU machine that has torch but cannot install packages.
#   scripts/gpu_tests.sh run [--out DIR] [--workers N] [--budget S] [--rerun-budget S] [PYTEST ARGS...]
#       on the GPU machine: installs .whl/serve/*.whl (if any) into /tmp/site, runs the suite with
#       pytest-xdist (N workers share the GPU; default 12) and pytest-timeout (240 s a test), then
#       re-runs the failures one at a time: a test that fails in parallel and passes alone is the
#       parallel run's (GPU memory taken by another worker), not a bug. Writes DIR/suite.log,
#       DIR/suite.xml (junit) and DIR/rerun.log (DIR default /tmp/moet-gpu-tests). The parallel
#       pass stops after --budget seconds (default 330; pytest still writes its summary), the re-run
#       after --rerun-budget (150).
#       PYTEST ARGS replace the default "tests".
set -uo pipefail
cd "$(dirname "$0")/.."

wheels() {
    mkdir -p .whl/serve
    local pkgs=() p v
    for p in fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection \
             opentelemetry-api openai httpx2 httpcore2 truststore distro jiter sniffio anyio idna \
             typing_extensions httpx httpcore h11 \
             import-linter grimp click rich markdown-it-py mdurl pygments xgrammar apache-tvm-ffi; do
        v=$(python3 -m pip show "$p" 2>/dev/null | sed -n 's/^Version: //p')
        [ -n "$v" ] && pkgs+=("$p==$v")
    done
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl/serve "${pkgs[@]}"
    du -sh .whl/serve
}

run() {
    local out=/tmp/moet-gpu-tests workers=12 budget=330 rerun_budget=150 args=()
    while [ $# -gt 0 ]; do
        case "$1" in
            --out) out=$2; shift 2 ;;
            --workers) workers=$2; shift 2 ;;
            --budget) budget=$2; shift 2 ;;
            --rerun-budget) rerun_budget=$2; shift 2 ;;
            *) args+=("$1"); shift ;;
        esac
    done
    [ ${#args[@]} -eq 0 ] && args=(tests)
    mkdir -p "$out"
    if ls .whl/serve/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/serve/*.whl || exit 1
        export PYTHONPATH=/tmp/site:$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}
    else
        export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}
    fi
    export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1   # workers x torch threads: one core each
    python3 -c "import torch; print('torch', torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name(0))"
    # lm-eval and what it pulls in (datasets, pyarrow, pandas, scikit-learn, ...) are far beyond the
    # wheels this script carries: where it is missing, its module is left out, and said so (CPU CI runs it)
    if ! python3 -c "import lm_eval" >/dev/null 2>&1; then
        echo "lm_eval not installed: tests/serve/test_harness_clients.py left out"
        args+=(--ignore=tests/serve/test_harness_clients.py)
    fi
    local cache=/tmp/moet-gpu-pytest-cache
    rm -rf "$cache"
    timeout -s INT -k 30 "$budget" python3 -m pytest -q -n "$workers" --timeout 240 -o cache_dir="$cache" \
        -rfEs --durations=25 --junitxml="$out/suite.xml" "${args[@]}" 2>&1 | tee "$out/suite.log" | tail -n 80
    local rc=${PIPESTATUS[0]}
    echo "parallel pass rc=$rc"
    # the failures again, one process, one test at a time (none: nothing runs)
    timeout -s INT -k 20 "$rerun_budget" python3 -m pytest -q --timeout 240 -o cache_dir="$cache" --lf --lfnf none \
        -rfE "${args[@]}" \
        2>&1 | tee "$out/rerun.log" | tail -n 60
    return "$rc"
}

case "${1:-}" in
    wheels) wheels ;;
    run) shift; run "$@" ;;
    *) sed -n '2,16p' "$0"; exit 2 ;;
esac
