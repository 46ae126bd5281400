#!/usr/bin/env bash
# Set up and run the whole test suite (real daemon, real processes; about 6 minutes on 2 idle cores).
# Two pytest-xdist workers, each running one whole test file at a time (--dist loadfile), so a
# module's shared daemon and fixtures are still started once; `-n 0` after it runs in one process.
# Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
