"""Decides device, dtype and distributed backend from the hardware that is present.

One place for these decisions so that the CLI, the Web-UI and the pipelines agree.
"""
from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass(frozen=True)
class Hardware:
    device: str  # "cuda" | "npu" | "cpu"
    name: str
    capability: tuple[int, int] | None = None  # CUDA compute capability
    cpu_bf16: bool = False  # CPU has AMX-BF16 or AVX-512-BF16


def detect() -> Hardware:
    import torch
    if torch.cuda.is_available():
        return Hardware("cuda", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
    try:
        import torch_npu  # noqa: F401  (Ascend; registers torch.npu)
        if torch.npu.is_available():
            return Hardware("npu", torch.npu.get_device_name(0))
    except ImportError:
        pass
    return Hardware("cpu", "cpu", cpu_bf16=cpu_has_bf16())


def cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def default_dtype(hw: Hardware) -> str:
    """bf16 on Ampere+ CUDA and on Ascend; fp16 on pre-Ampere CUDA (T4, V100); fp32 on CPU."""
    if hw.device == "cuda":
        return "bfloat16" if hw.capability and hw.capability >= (8, 0) else "float16"
    if hw.device == "npu":
        return "bfloat16"
    return "float32"


def resolve_dtype(requested: str, hw: Hardware) -> str:
    return default_dtype(hw) if requested in (None, "auto") else requested


def backend(hw: Hardware) -> str:
    return {"cuda": "nccl", "npu": "hccl"}.get(hw.device, "gloo")
