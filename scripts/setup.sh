#!/usr/bin/env bash
# Create .venv (if missing) and install swiftlite with its test tools, CPU torch first.
#   bash scripts/setup.sh            (idempotent; safe to run again)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q -U pip
# torch==2.13.0 first: on a CPU machine it is the small CPU wheel; asking for a newer torch
# (or letting a dependency pick one) would pull a multi-GB CUDA build. GPU users: install the
# torch build for your CUDA first, then `pip install -e .` (any torch >= 2.6 works).
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q "torch==2.13.0"
.venv/bin/pip install -q -e ".[test]"
echo "swiftlite is installed in $(pwd)/.venv (activate: source .venv/bin/activate)"
