# Sourced by scripts/setup-vllm.sh and scripts/setup-vllm-cuda.sh (not run on its own): the one
# resolution of hwr's `vllm` extra on the CPU build of vLLM that both environments start from, so the
# two recipes cannot drift apart. Run from the repository root.
#   1. torch 2.13.0+cpu first (a bare requirement would pull a CUDA build);
#   2. the extra with a constraint pinning torch==2.13.0+cpu (vllm-cpu 0.30.0 pins that build), so
#      nothing replaces the CPU torch while every other dependency of vLLM-Omni and vLLM resolves.

VLLM_OMNI_VERSION=0.30.0
VLLM_CPU_VERSION=0.30.0
VLLM_TORCH_VERSION=2.13.0

# vllm_versions_installed PYTHON NAME=VERSION...: exit 0 when vllm-omni and vllm-cpu are at the
# recipe's versions and every NAME is at its VERSION in PYTHON's environment (the idempotence check).
vllm_versions_installed() {
  local py=$1
  shift
  "$py" - "vllm-omni=$VLLM_OMNI_VERSION" "vllm-cpu=$VLLM_CPU_VERSION" "$@" <<'PYEOF' 2>/dev/null
import importlib.metadata as m, sys
want = dict(arg.split("=", 1) for arg in sys.argv[1:])
sys.exit(0 if all(m.version(k) == v for k, v in want.items()) else 1)
PYEOF
}

# vllm_cpu_resolution PYTHON: steps 1 and 2 above, into PYTHON's environment (hwr editable, with its
# test and vllm extras).
vllm_cpu_resolution() {
  local py=$1 constraints rc=0
  constraints=$(mktemp)
  echo "torch==$VLLM_TORCH_VERSION+cpu" >"$constraints"
  "$py" -m pip install -q "torch==$VLLM_TORCH_VERSION+cpu" \
    && "$py" -m pip install -q -c "$constraints" -e '.[test,vllm]' || rc=$?
  rm -f "$constraints"
  return "$rc"
}
