#!/usr/bin/env bash
# The main job: set up, start hwrd on a local store, publish a generated DiT checkpoint,
# and show N workers sharing one copy. Arguments go to `python -m hwr.demo` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m hwr.demo "$@"
