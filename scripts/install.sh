#!/usr/bin/env bash
# Installs moet (editable) and what it needs.
# torch: a machine that already has a torch (e.g. a CUDA build on a GPU box) keeps it;
# otherwise the CPU wheel torch==2.13.0 is installed first, so pip never pulls a
# multi-GB CUDA build for a CPU machine.
#   scripts/install.sh          runtime only
#   scripts/install.sh --test   plus the test extra (pytest, hypothesis, openai, lm-eval[api], ...:
#                               pyproject.toml) and triton for the interpreted kernel tests
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "[install] no torch found: installing the CPU wheel torch==2.13.0"
    "$PY" -m pip install -q "torch==2.13.0"
fi
extras=""
if [ "${1:-}" = "--test" ]; then
    extras="[test]"
    # The Triton kernels are tested on CPU through TRITON_INTERPRET=1. CUDA builds of torch
    # bring their own (exactly pinned) triton, which must stay; elsewhere take the version the
    # H200 box's torch 2.11 ships.
    if ! "$PY" -c "import triton" >/dev/null 2>&1; then
        echo "[install] no triton found: installing triton==3.6.0 (CPU tests run it interpreted)"
        "$PY" -m pip install -q "triton==3.6.0"
    fi
fi
"$PY" -m pip install -q -e ".${extras}"
