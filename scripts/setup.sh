#!/usr/bin/env bash
# Create ./.venv (if missing) with torch 2.13.0 (CPU) and hwr installed editable with its test extra.
# Idempotent: a second run only re-checks the install. Python >= 3.11 required.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
# torch first and pinned: a bare "torch" requirement would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[test]'
