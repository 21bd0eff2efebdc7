#!/usr/bin/env bash
# Set up everything the test suite needs and run it (what CI runs).
#   bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
# pip compiles every module it installs to bytecode: tens of thousands of files in the three
# venvs, minutes of CPU on 2 cores, of which the suite imports a few thousand (Python compiles
# those as it first imports them). pip reads PIP_NO_COMPILE as the option's value: 0 is
# --no-compile. A user's `bash scripts/setup.sh` compiles everything, for a short first start.
# Python must then be free to keep what it compiles: under PYTHONDONTWRITEBYTECODE every process
# of the suite would compile every module it imports again.
export PIP_NO_COMPILE=0
unset PYTHONDONTWRITEBYTECODE
# Three installs that need nothing of each other run at once, each logging to a file shown
# when it ends: llama.cpp (converter, runtime, quantizer) for the export tests, built from source
# once per machine (about two minutes on 2 cores; SWIFTLITE_SKIP_LLAMACPP=1 leaves it out);
# vLLM's CPU build in a venv of its own for the --infer_backend vllm tests (SWIFTLITE_SKIP_VLLM=1
# leaves it out and those tests skip, saying so); swiftlite's own venv, in the foreground.
logs=$(mktemp -d)
declare -A pids
background() {  # name, command...: runs it in the background, its output in $logs/name
  local name=$1
  shift
  "$@" >"$logs/$name" 2>&1 &
  pids[$name]=$!
}
finished() {  # name, what a failure means: waits for it (if started), then shows how it ended
  [ -n "${pids[$1]:-}" ] || return 0
  if wait "${pids[$1]}"; then tail -1 "$logs/$1"; else tail -40 "$logs/$1"; echo "$1 failed: $2"; fi
  echo "setup: $1 done at ${SECONDS} s"
}
[ "${SWIFTLITE_SKIP_LLAMACPP:-0}" = 1 ] || background llamacpp bash scripts/setup_llamacpp.sh
[ "${SWIFTLITE_SKIP_VLLM:-0}" = 1 ] || background vllm bash scripts/setup_vllm.sh
bash scripts/setup.sh
echo "setup: swiftlite's venv done at ${SECONDS} s"
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
    background apt bash -c "apt-get update -qq && apt-get install -y -qq ${missing[*]} >/dev/null"
  else
    echo "missing: sudo apt-get install -y ${missing[*]} (the browser, allocator and Modelfile tests will fail or skip)"
  fi
fi
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 GRADIO_ANALYTICS_ENABLED=False
# The venv's tools first, as in an activated venv (DeepSpeed finds the venv's ninja, whose
# command hash keys its cache of built ops).
export PATH="$PWD/.venv/bin:$PATH"
# DeepSpeed JIT-builds CPU Adam (offload_optimizer: cpu) on first use and caches it under
# ~/.cache/torch_extensions. Built here, with the rest of the setup, so that the suite's time is
# the tests'.
.venv/bin/python scripts/build_deepspeed_ops.py \
  || echo "DeepSpeed's CPU Adam did not build here: the first offload test will try again"
echo "setup: DeepSpeed's CPU Adam done at ${SECONDS} s"
finished apt "the browser, allocator and Modelfile tests will fail or skip"
finished vllm "the vLLM tests will skip"
finished llamacpp "the GGUF export tests will skip"
rm -rf "$logs"
echo "setup: ${SECONDS} s"
# Two pytest workers (pytest-xdist), a test file each at a time: most of the suite waits on a
# child process starting (a CLI, a server, a browser), so one worker left a core idle. The
# trained checkpoints that files share are made once (tests/conftest.py: once). The files go out
# longest first (tests/conftest.py: LONGEST_FIRST), not by their number of tests.
# SWIFTLITE_TEST_WORKERS=0 runs in this process, as plain pytest does.
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 \
  -n "${SWIFTLITE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
