"""Decides device, dtype, attention implementation and distributed backend from the hardware
that is present. One place for these decisions, so that the CLI, the Web-UI, the pipelines and
`swiftlite estimate` agree.

Detection (`detect`) touches torch; every decision below it is a pure function of a `Hardware`
value, so each one is unit-tested with the capabilities given by hand.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from swiftlite.errors import UsageError

DTYPES = ("auto", "bfloat16", "float16", "float32")

# `--torch_dtype auto` on a CPU: fp32, except LoRA training where the CPU has bf16 units
# (training_dtype).
CPU_DTYPE = "float32"

AMPERE = (8, 0)  # first CUDA generation with bf16 and flash-attention 2 (A100, A10, 3090)


@dataclass(frozen=True)
class Hardware:
    device: str  # "cuda" | "npu" | "cpu"
    name: str
    capability: tuple[int, int] | None = None  # CUDA compute capability
    cpu_bf16: bool = False  # CPU has AMX-BF16 or AVX-512-BF16
    count: int = 1  # visible devices of this kind
    memory_bytes: int | None = None  # memory of one device (None on CPU)
    npu_bf16: bool = True  # an NPU with bf16 units (Ascend 910B and later; not the 910A)


def detect() -> Hardware:
    import torch
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return Hardware("cuda", torch.cuda.get_device_name(0),
                        tuple(torch.cuda.get_device_capability(0)),
                        count=torch.cuda.device_count(), memory_bytes=props.total_memory)
    try:
        import torch_npu  # noqa: F401  (Ascend; registers torch.npu)
        if torch.npu.is_available():
            bf16 = getattr(torch.npu, "is_bf16_supported", lambda: True)()
            return Hardware("npu", torch.npu.get_device_name(0), count=torch.npu.device_count(),
                            npu_bf16=bool(bf16))
    except ImportError:
        pass
    return Hardware("cpu", "cpu", cpu_bf16=cpu_has_bf16())


def accelerator():
    """torch.cuda or torch.npu, whichever has a device here; None on a CPU. The memory calls
    (max_memory_allocated, empty_cache, ...) have the same names in both."""
    import torch
    for name in ("cuda", "npu"):
        mod = getattr(torch, name, None)
        if mod is not None and mod.is_available():
            return mod
    return None


# The CPU flags swiftlite's choices read, best first: AMX-BF16 (Intel Sapphire Rapids and
# later: bf16 tile matmuls) and AVX-512-BF16 (AMD Zen 4 and later, Intel Cooper Lake: bf16 dot
# products) make a bf16 frozen base faster than fp32; without them bf16 is emulated and slower.
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
CPU_FLAGS = (*CPU_BF16_FLAGS, "avx512f", "avx2")


def _cpuinfo(path: str) -> dict[str, str]:
    """The `name : value` fields of the first processor in /proc/cpuinfo ({} when unreadable)."""
    fields = {}
    try:
        with open(path) as f:
            for line in f:
                if not line.strip():  # the end of the first processor's block
                    break
                name, _, value = line.partition(":")
                fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    return fields


def _flags(fields: dict[str, str]) -> tuple[str, ...]:
    have = set(fields.get("flags", "").split())
    return tuple(f for f in CPU_FLAGS if f in have)


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, ...]:
    """The flags of CPU_FLAGS this CPU has, in CPU_FLAGS' order."""
    return _flags(_cpuinfo(cpuinfo))


def cpu_has_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    return any(f in CPU_BF16_FLAGS for f in cpu_flags(cpuinfo))


def describe_cpu(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU, and the flags that decide its dtype, for the run log: e.g. "AMD EPYC, 2 cores:
    avx512_bf16 avx512f avx2, no amx_bf16"."""
    fields = _cpuinfo(cpuinfo)
    flags = _flags(fields)
    missing = [f for f in CPU_BF16_FLAGS if f not in flags]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"{fields.get('model name') or 'unknown CPU'}, "
            f"{cores} cores: {' '.join(flags) or 'none of ' + ' '.join(CPU_FLAGS)}"
            + (f", no {' '.join(missing)}" if missing and flags else ""))


def has_bf16(hw: Hardware) -> bool:
    """Native bf16 arithmetic (pre-Ampere GPUs only emulate it, slowly)."""
    if hw.device == "cuda":
        return bool(hw.capability) and hw.capability >= AMPERE
    return hw.npu_bf16 if hw.device == "npu" else hw.cpu_bf16


def warn_if_emulated_bf16(dtype: str, hw: Hardware) -> None:
    """A CPU without bf16 units (CPU_BF16_FLAGS) emulates bf16 matmuls, at a small fraction of
    its fp32 rate (docs/performance.md): say so when bf16 was asked for there, rather than let
    a run crawl without a reason."""
    if dtype == "bfloat16" and hw.device == "cpu" and not hw.cpu_bf16:
        from swiftlite.log import warn
        warn(f"--torch_dtype bfloat16 on {describe_cpu()}: this CPU has no bf16 units (none of "
             f"{' '.join(CPU_BF16_FLAGS)}), so its bf16 matmuls are emulated and many times "
             "slower than fp32; --torch_dtype auto or float32 runs fp32 here.")


def default_dtype(hw: Hardware) -> str:
    """bf16 on Ampere+ CUDA and on Ascend 910B+; fp16 (with loss scaling) on pre-Ampere CUDA
    such as T4 and V100 and on NPUs without bf16 (910A); fp32 on a CPU (see training_dtype
    for LoRA training there)."""
    if hw.device in ("cuda", "npu"):
        return "bfloat16" if has_bf16(hw) else "float16"
    return CPU_DTYPE


def resolve_dtype(requested: str | None, hw: Hardware) -> str:
    """The compute dtype for `--torch_dtype`; refuses combinations the hardware cannot run."""
    if requested in (None, "auto"):
        return default_dtype(hw)
    if requested not in DTYPES:
        raise UsageError(f"--torch_dtype {requested}: choose one of {', '.join(DTYPES)}.")
    if requested == "bfloat16" and hw.device in ("cuda", "npu") and not has_bf16(hw):
        cap = f" (compute capability {'.'.join(map(str, hw.capability))})" \
            if hw.capability else ""
        raise UsageError(f"--torch_dtype bfloat16: {hw.name}{cap} has no bfloat16 units; use "
                         "--torch_dtype float16 (loss-scaled) or float32.")
    if requested == "float16" and hw.device == "cpu":
        raise UsageError("--torch_dtype float16: mixed-precision fp16 training needs a GPU or "
                         "NPU; on a CPU use float32 or bfloat16.")
    return requested


def training_dtype(requested: str | None, hw: Hardware, train_type: str = "lora",
                   deepspeed: str | None = None, quantized: bool = False) -> str:
    """`swiftlite sft`'s compute dtype. On a CPU with AMX-BF16 or AVX-512-BF16, `auto` trains
    LoRA on a bf16 base with fp32 activations, LoRA weights and optimizer
    (training/speedups/fp32_activations.py),
    faster than fp32 at the same final loss (docs/performance.md).
    Full fine-tuning (it needs fp32 master weights) and DeepSpeed on a CPU stay fp32, and so
    does a quantized (QLoRA) base on a CPU: bitsandbytes' layers would return bf16, and bf16
    activations round small LoRA updates away (speedups/fp32_activations.py)."""
    dtype = resolve_dtype(requested, hw)
    if requested in (None, "auto") and hw.device == "cpu":
        bf16 = hw.cpu_bf16 and train_type == "lora" and not deepspeed and not quantized
        return "bfloat16" if bf16 else CPU_DTYPE
    if hw.device == "cpu" and deepspeed and train_type == "full" and dtype != CPU_DTYPE:
        from swiftlite.log import warn
        warn(f"full fine-tuning with --deepspeed on a CPU trains in {CPU_DTYPE}, not {dtype}: "
             "DeepSpeed's 16-bit mode is off on a CPU, and 16-bit weights without fp32 "
             "masters would round most of AdamW's steps away")
        return CPU_DTYPE
    return dtype


def inference_dtype(requested: str | None, trained: str | None, hw: Hardware) -> str:
    """infer/deploy's dtype: --torch_dtype when given; else the device's own. A GPU or NPU runs
    its 16-bit dtype whatever the training dtype was (a bf16 checkpoint on a T4 in fp16, an
    fp32 one on an A100 in bf16: half the memory, the fast kernels). A CPU keeps the training
    dtype where it runs it well: bf16 only with bf16 units, never fp16 (slow matmuls)."""
    if requested == "float16" and hw.device == "cpu":
        return requested  # asked for: slow, but no loss scaling is needed to run it
    if requested not in (None, "auto"):
        return resolve_dtype(requested, hw)
    if hw.device in ("cuda", "npu"):
        return default_dtype(hw)
    return "bfloat16" if trained == "bfloat16" and hw.cpu_bf16 else CPU_DTYPE


def weights_dtype(dtype: str, train_type: str, deepspeed: bool = False) -> str:
    """The dtype to load weights in for compute dtype `dtype`.

    Full fine-tuning with 16-bit compute keeps fp32 master weights and lets autocast run the
    layers in 16 bits. fp16: torch's GradScaler refuses fp16 gradients on the weights it steps
    ("Attempting to unscale FP16 gradients"). bf16: AdamW's steps are about the learning rate,
    and bf16 rounds away a step below half its resolution at the weight, so most of a model
    stopped learning (docs/reliability.md). DeepSpeed keeps fp32 masters of its own under
    bf16, so there the weights load in bf16. LoRA needs no copy: peft keeps the adapter
    weights in fp32 while the frozen base stays 16-bit.
    """
    if train_type == "full" and (dtype == "float16" or (dtype == "bfloat16" and not deepspeed)):
        return "float32"
    return dtype


def amp_flags(dtype: str, hw: Hardware, weights: str | None = None) -> dict:
    """TrainingArguments mixed-precision flags: fp16 turns on the Trainer's loss scaling. On a
    CPU bf16 autocast only over fp32 master weights (`weights`: their dtype); LoRA's bf16 base
    computes in bf16 with fp32 activations there instead (speedups/fp32_activations.py)."""
    bf16 = dtype == "bfloat16" and (hw.device != "cpu" or weights == "float32")
    return {"bf16": bf16, "fp16": dtype == "float16"}


def flash_attn_installed() -> bool:
    """flash_attn is installed and imports. A wheel built for another torch or CUDA is found
    but fails to import (an undefined symbol): that falls back to SDPA, saying so, rather
    than crashing at model load."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        import flash_attn  # noqa: F401
    except Exception as e:  # ImportError, OSError from its .so, RuntimeError from its checks
        from swiftlite.log import warn
        warn(f"flash-attn is installed but does not import ({type(e).__name__}: "
             f"{str(e)[:200]}); using PyTorch SDPA. Reinstall it for this torch "
             "(pip install flash-attn --no-build-isolation) to use it.")
        return False
    return True


def attn_implementation(hw: Hardware, dtype: str | None = None) -> str:
    """flash_attention_2 on Ampere+ CUDA when the flash_attn package is installed and the
    dtype is 16-bit (its kernels have no fp32 path); otherwise PyTorch SDPA, which every
    device here runs (memory-efficient kernels on CUDA, fused CPU kernels). Pre-Ampere GPUs
    have no flash-attention 2 kernels."""
    if (hw.device == "cuda" and has_bf16(hw) and dtype in (None, "bfloat16", "float16")
            and flash_attn_installed()):
        return "flash_attention_2"
    return "sdpa"


def backend(hw: Hardware) -> str:
    """torch.distributed backend: NCCL on CUDA, HCCL on Ascend, gloo on CPU."""
    return {"cuda": "nccl", "npu": "hccl"}.get(hw.device, "gloo")


def describe(hw: Hardware) -> str:
    """One line for logs: what was found and what was decided."""
    dtype = default_dtype(hw)
    if hw.device == "cpu" and hw.cpu_bf16:
        dtype += " (LoRA training: bfloat16 base, fp32 activations)"
    mem = f", {hw.memory_bytes / 2**30:.0f} GiB" if hw.memory_bytes else ""
    cap = f", compute capability {hw.capability[0]}.{hw.capability[1]}" if hw.capability else ""
    return (f"{hw.count} x {hw.name} ({hw.device}{cap}{mem}): default dtype {dtype}, "
            f"attention {attn_implementation(hw, dtype)}, backend {backend(hw)}")
