#!/usr/bin/env bash
# Installs moet (editable) and what it needs.
# torch: a machine that already has a torch (e.g. a CUDA build on a GPU box) keeps it;
# otherwise the CPU wheel torch==2.13.0 is installed first, so pip never pulls a
# multi-GB CUDA build for a CPU machine.
#   scripts/install.sh          runtime only
#   scripts/install.sh --test   plus the test extras (pytest, hypothesis)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "[install] no torch found: installing the CPU wheel torch==2.13.0"
    "$PY" -m pip install -q "torch==2.13.0"
fi
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
"$PY" -m pip install -q -e ".${extras}"
