#!/usr/bin/env bash
# Set up and run the whole test suite (real daemon, real processes; about 13 minutes on 2 idle cores).
# Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
