"""Skip marks for what this machine may lack: bf16 units, vLLM's and llama.cpp's venvs, Go."""
from __future__ import annotations

import glob
import os
import shutil

import pytest

from swiftlite.runtime.hardware import CPU_BF16_FLAGS, cpu_has_bf16

from helpers.cli import REPO

# A CPU without bf16 units (AVX2 only: none of runtime.hardware.CPU_BF16_FLAGS) emulates bf16
# matmuls at about a hundredth of its fp32 rate, and swiftlite trains in fp32 there. The long
# bf16 training tests run where swiftlite would train in bf16 (two of the three CPU kinds seen).
needs_bf16_units = pytest.mark.skipif(
    not cpu_has_bf16(), reason=f"this CPU emulates bf16 matmuls (none of "
                               f"{' '.join(CPU_BF16_FLAGS)}), at about 1/100 of its fp32 rate; "
                               "swiftlite trains in fp32 here")
BF16_CPU_TRAINING = pytest.param("bfloat16", marks=needs_bf16_units, id="bfloat16")
# Short bf16 checks (a forward and backward or two) run everywhere; where bf16 is emulated they
# take tens of seconds instead of a few, so there they belong to the full suite, not the fast tier.
BF16_MATH = pytest.param("bfloat16", marks=() if cpu_has_bf16() else pytest.mark.slow,
                         id="bfloat16")


def slow_bf16_math(test):
    """A test of bf16 arithmetic: in the fast tier only where bf16 is not emulated."""
    return test if cpu_has_bf16() else pytest.mark.slow(test)


# vLLM lives in a venv of its own (scripts/setup_vllm.sh; CI makes it).
VLLM_PYTHON = os.environ.get("SWIFTLITE_VLLM_PYTHON") or os.path.join(REPO, ".venv-vllm", "bin",
                                                                       "python")
needs_vllm = pytest.mark.skipif(not os.path.exists(VLLM_PYTHON),
                                reason="no vLLM venv: run bash scripts/setup_vllm.sh")
# vLLM's CPU build reserves its KV cache up front (default 4 GiB); tiny models need little.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
# Eager: vLLM's torch.compile warm-up takes about 50 s per model on 2 cores.
VLLM_FLAGS = ("--vllm_args=--enforce-eager", "--max_model_len", "1024")
# vLLM's engine and worker in its API server's process instead of two more (each imports torch
# and vLLM again: 63-65 s to /health vs 48 s for tiny-qwen2 here). The tests of answers use it;
# the test of vLLM's process tree (test_deploy_vllm's SIGKILL) keeps vLLM's default layout.
VLLM_ONE_PROCESS_ENV = {**VLLM_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
VLLM_ONE_PROCESS_FLAGS = (VLLM_FLAGS[0] + " --distributed-executor-backend uni", *VLLM_FLAGS[1:])


# llama.cpp (its converter, runtime and quantizer) lives in a venv of its own
# (scripts/setup_llamacpp.sh; CI makes it): `swiftlite export --format gguf` and its tests.
LLAMACPP_VENV = os.environ.get("SWIFTLITE_LLAMACPP_VENV") or os.path.join(REPO, ".venv-llamacpp")
LLAMACPP_PYTHON = os.path.join(LLAMACPP_VENV, "bin", "python")
HAS_LLAMACPP = bool(
    os.path.exists(os.path.join(LLAMACPP_VENV, "share", "llama.cpp", "convert_hf_to_gguf.py"))
    and glob.glob(os.path.join(LLAMACPP_VENV, "lib", "python*", "site-packages", "llama_cpp",
                               "lib", "libllama.so*")))
needs_llamacpp = pytest.mark.skipif(not HAS_LLAMACPP,
                                    reason="no llama.cpp venv: run bash scripts/setup_llamacpp.sh")
# Ollama's TEMPLATE is Go text/template: rendered by Go itself (Debian's golang-go).
needs_go = pytest.mark.skipif(shutil.which("go") is None,
                              reason="no Go toolchain to render Ollama templates with: "
                                     "apt-get install golang-go (scripts/test.sh does)")
