"""Skip marks for what this machine may lack: bf16 units, vLLM's venv."""
from __future__ import annotations

import os

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
