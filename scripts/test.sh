#!/usr/bin/env bash
# Set up everything the test suite needs and run it (what CI runs).
#   bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
# llama.cpp (converter, runtime, quantizer) for the export tests: built from source once per
# machine (about two minutes on 2 cores), then skipped; SWIFTLITE_SKIP_LLAMACPP=1 leaves it out.
# The build starts first and runs while the installs below wait on the network.
llamacpp_log=$(mktemp)
llamacpp_pid=
if [ "${SWIFTLITE_SKIP_LLAMACPP:-0}" != 1 ]; then
  bash scripts/setup_llamacpp.sh >"$llamacpp_log" 2>&1 &
  llamacpp_pid=$!
fi
bash scripts/setup.sh
# vLLM's CPU build in a venv of its own, for the --infer_backend vllm tests (about a minute;
# SWIFTLITE_SKIP_VLLM=1 leaves it out and those tests skip, saying so).
[ "${SWIFTLITE_SKIP_VLLM:-0}" = 1 ] || bash scripts/setup_vllm.sh \
  || echo "scripts/setup_vllm.sh failed: the vLLM tests will skip"
# The Web-UI tests drive Debian's Chromium through Playwright (Playwright's own browser
# download is not reachable offline); tcmalloc is the allocator swiftlite preloads when present
# (lower peak memory, see swiftlite/runtime/allocator.py), and its tests need it; Go renders
# the Ollama Modelfile templates that swiftlite export writes (Go's own text/template).
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v go >/dev/null 2>&1 || missing+=(golang-go)
.venv/bin/python -c "import sys; from swiftlite.runtime.allocator import find_tcmalloc; sys.exit(find_tcmalloc() is None)" \
  || missing+=(libtcmalloc-minimal4)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null) || echo "apt-get install ${missing[*]} failed"
  else
    echo "missing: sudo apt-get install -y ${missing[*]} (the browser, allocator and Modelfile tests will fail or skip)"
  fi
fi
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 GRADIO_ANALYTICS_ENABLED=False
# The venv's tools first, as in an activated venv (the tests' DeepSpeed runs find its ninja).
export PATH="$PWD/.venv/bin:$PATH"
# DeepSpeed JIT-builds two CPU ops on first use and caches them under ~/.cache/torch_extensions:
# CPU Adam (offload_optimizer: cpu, about 70 s) and its shared-memory all-reduce (about 50 s).
# Built here, with the rest of the setup, so that the suite's time is the tests'.
.venv/bin/python scripts/build_deepspeed_ops.py \
  || echo "DeepSpeed's CPU ops did not build here: the first DeepSpeed tests will try again"
if [ -n "$llamacpp_pid" ]; then
  wait "$llamacpp_pid" && tail -2 "$llamacpp_log" \
    || { tail -40 "$llamacpp_log"; echo "scripts/setup_llamacpp.sh failed: the GGUF export tests will skip"; }
fi
rm -f "$llamacpp_log"
echo "setup: ${SECONDS} s"
# Two pytest workers (pytest-xdist), a test file each at a time: most of the suite waits on a
# child process starting (a CLI, a server, a browser), so one worker left a core idle. The
# trained checkpoints that files share are made once (tests/conftest.py: once).
# SWIFTLITE_TEST_WORKERS=0 runs in this process, as plain pytest does.
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 \
  -n "${SWIFTLITE_TEST_WORKERS:-2}" --dist loadfile "$@"
