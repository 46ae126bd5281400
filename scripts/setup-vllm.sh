#!/usr/bin/env bash
# Install hwr's `vllm` extra (vLLM-Omni 0.30.0 + the CPU build of vLLM 0.30.0) into ./.venv on a CPU
# machine, following the checked recipe (about 3 minutes and 4.4 GB on first install):
#   1. and 2. the resolution shared with scripts/setup-vllm-cuda.sh (scripts/vllm-recipe.sh): torch
#      2.13.0+cpu first, then the extra with a constraint pinning it, so nothing replaces the CPU torch;
#   3. remove torchvision/torchaudio/torchcodec: their PyPI builds are CUDA-linked and break
#      imports on CPU; nothing hwr or the tests use needs them.
# Idempotent: exits early when the pinned versions are already there (HWR_VLLM_FORCE=1 reinstalls).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
PY=.venv/bin/python
. scripts/vllm-recipe.sh
if [ "${HWR_VLLM_FORCE:-0}" != 1 ] && vllm_versions_installed "$PY" "torch=$VLLM_TORCH_VERSION+cpu"; then
  echo "setup-vllm: vllm extra already installed"
  exit 0
fi
vllm_cpu_resolution "$PY"
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec
"$PY" - "$VLLM_TORCH_VERSION+cpu" <<'PYEOF'
import sys
import torch, vllm, vllm_omni  # noqa: F401  (all three must import on CPU)
assert torch.__version__ == sys.argv[1], f"torch was replaced: {torch.__version__}"
print(f"setup-vllm: torch {torch.__version__}, vllm {vllm.__version__}, vllm-omni {vllm_omni.__version__}")
PYEOF
