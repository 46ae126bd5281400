#!/usr/bin/env bash
# Create ./.venv (if missing) with torch 2.13.0 (CPU) and hwr installed editable with its test extra.
# Idempotent: a second run only re-checks the install. Python >= 3.11 required.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  # What a fresh machine may lack, each named in one line with how to get it.
  if ! command -v "$PY" >/dev/null 2>&1; then
    echo "setup.sh: $PY not found: install Python >= 3.11 (Debian: apt-get install python3 python3-venv) or set PYTHON=/path/to/python3" >&2
    exit 1
  fi
  if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "setup.sh: $("$PY" --version 2>&1) is too old: hwr needs Python >= 3.11 (set PYTHON=/path/to/python3.11)" >&2
    exit 1
  fi
  if ! "$PY" -c 'import ensurepip, venv' >/dev/null 2>&1; then
    echo "setup.sh: $PY cannot create a venv (no ensurepip): Debian: apt-get install python3-venv" >&2
    exit 1
  fi
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
# torch first and pinned: a bare "torch" requirement would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[test]'
