"""Out-of-memory during training, answered with the next step of the tuning ladder.

The ladder, cheapest in speed first (the order of Hugging Face's DeepSpeed guide):
per-device batch 1 with the same total batch through gradient accumulation -> gradient
checkpointing -> ZeRO-2 -> ZeRO-2 with the optimizer offloaded to CPU -> ZeRO-3 -> ZeRO-3 with
parameters offloaded too -> 16-bit weights. The next step is read from the CURRENT arguments,
so a run that already uses ZeRO-2 is told to try zero2_offload, not zero2 again.
"""
from __future__ import annotations

import contextlib

from swiftlite.errors import RunError

# Messages of allocators that ran out: CUDA/NPU caching allocators, PyTorch's CPU allocator,
# and the C library (ENOMEM).
_OOM_TEXT = ("out of memory", "can't allocate memory", "cannot allocate memory",
             "not enough memory", "failed to allocate memory")

def is_oom(exc: BaseException) -> bool:
    import torch
    if isinstance(exc, (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))):
        return True
    return isinstance(exc, RuntimeError) and any(t in str(exc).lower() for t in _OOM_TEXT)


def zero_setup(deepspeed) -> tuple[int, bool, bool] | None:
    """(stage, offload_optimizer, offload_param) of a --deepspeed value, read as the run reads
    it; (-1, False, False) without DeepSpeed; None when the value cannot be read (then no
    DeepSpeed step is suggested blindly)."""
    if not deepspeed:
        return (-1, False, False)
    from swiftlite.errors import UsageError
    from swiftlite.training.deepspeed import load_config, zero_stage
    try:
        config = load_config(deepspeed)
    except UsageError:
        return None
    zero = config.get("zero_optimization") or {}

    def offloaded(key):
        return (zero.get(key) or {}).get("device", "none") not in ("none", None)
    return zero_stage(config), offloaded("offload_optimizer"), offloaded("offload_param")


def ladder(args, world_size: int = 1, hw=None) -> list[tuple[str, str]]:
    """Remaining steps as (flags, why), the next one first, for the current arguments."""
    steps = []
    batch = args.per_device_train_batch_size
    accum = args.accumulation_steps(world_size)
    if batch > 1:
        steps.append((f"--per_device_train_batch_size 1 --gradient_accumulation_steps "
                      f"{batch * accum}", f"same total batch ({batch * accum * world_size}), "
                      "activations of one sample at a time"))
    if not args.gradient_checkpointing:
        steps.append(("--gradient_checkpointing true",
                      "recompute activations in backward instead of keeping them"))
    setup = zero_setup(args.deepspeed)
    if setup is not None:
        stage, off_opt, off_param = setup
        # Partitioning across one process saves nothing, so a single device goes straight to
        # the offload steps.
        multi = world_size > 1
        on_cpu = hw is not None and hw.device == "cpu"  # offloading to CPU from a CPU: no gain
        options = [("zero2", stage < 2 and multi, "partition optimizer states and gradients "
                    f"across the {world_size} processes"),
                   ("zero2_offload", stage <= 2 and not off_opt and not on_cpu,
                    "keep optimizer states in CPU memory (needs about 16 bytes per trainable "
                    "parameter of RAM)"),
                   ("zero3", stage < 3 and multi, "partition the parameters too"),
                   ("zero3_offload", not (stage == 3 and off_param) and not on_cpu,
                    "keep parameters and optimizer states in CPU memory")]
        for name, applies, why in options:
            if (applies and _ZERO_RANK[name] > _rank(stage, off_opt, off_param)
                    and not _refused(args, name)):
                steps.append((f"--deepspeed {name}", why))
    dtype = args.torch_dtype
    if dtype == "float32" and (hw is None or hw.device != "cpu"):
        from swiftlite.runtime.hardware import default_dtype
        half = default_dtype(hw) if hw is not None and hw.device != "cpu" else "bfloat16"
        # full fine-tuning without DeepSpeed keeps fp32 master weights in 16 bits
        # (hardware.weights_dtype): only the activations shrink
        what = ("16-bit activations over fp32 master weights" if args.train_type == "full"
                and setup is None else "16-bit weights and activations: half the memory of "
                "float32")
        steps.append((f"--torch_dtype {half}", what + ("" if half == "bfloat16" else
                                                       " (fp16: loss-scaled)")))
    if args.train_type == "full":
        steps.append(("--train_type lora", "train adapters only: no gradients or optimizer "
                      "states for the base weights"))
    steps.append((f"--max_length {max(256, args.max_length // 2)}",
                  "shorter samples (over-long ones are dropped or cut, see "
                  "--truncation_strategy)"))
    return steps


def _refused(args, preset: str) -> bool:
    """Whether the run refuses this preset (QLoRA, DoRA or PiSSA under ZeRO-3, LoRA+ with an
    offloaded optimizer): advice must not lead into a refusal."""
    from swiftlite.training.deepspeed import config_problems, load_config
    return bool(config_problems(args, load_config(preset)))


_ZERO_RANK = {"zero2": 2.0, "zero2_offload": 2.5, "zero3": 3.0, "zero3_offload": 3.5}


def _rank(stage: int, off_opt: bool, off_param: bool) -> float:
    return stage + 0.5 * (off_opt or off_param)


def advice(args, world_size: int = 1, hw=None, error: str = "") -> str:
    steps = ladder(args, world_size, hw)
    lines = [f"out of memory{f' ({error})' if error else ''}."]
    first, why = steps[0]
    lines.append(f"Next step: {first}  ({why})")
    if len(steps) > 1:
        lines.append("If that is not enough, then: " + "; then ".join(s for s, _ in steps[1:]))
    gpus = max(world_size, getattr(hw, "count", 1) or 1)
    memory = "24GB"
    if getattr(hw, "memory_bytes", None):
        memory = f"{hw.memory_bytes / 2**30:.0f}GB"
    elif getattr(hw, "device", None) == "cpu":  # a CPU run: the process's memory is the RAM
        import psutil
        memory = f"{psutil.virtual_memory().total / 2**30:.0f}GB"
    lines.append(f"To see what fits: swiftlite estimate --model {args.model} --gpus {gpus} "
                 f"--gpu_memory {memory} --train_type {args.train_type} --max_length "
                 f"{args.max_length}")
    return "\n".join(lines)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = next((t for t in text if any(k in t.lower() for k in _OOM_TEXT)), text[0] if text
                else type(exc).__name__)
    return line.strip()[:200]


@contextlib.contextmanager
def oom_guard(args, hw=None):
    """Turns an out-of-memory error inside the block into a RunError with the next steps."""
    try:
        yield
    except Exception as e:
        if not is_oom(e):
            raise
        from swiftlite.runtime.distributed import world_size
        free_memory()
        raise RunError(advice(args, world_size(), hw, _short(e))) from e


def free_memory() -> None:
    """Release cached blocks after an OOM, so the process can report and exit cleanly."""
    import gc

    from swiftlite.runtime import gc_start
    gc_start.unfreeze()  # the model frozen at the first step can be freed now
    gc.collect()
    try:
        from swiftlite.runtime.hardware import accelerator
        if (device := accelerator()) is not None:
            device.empty_cache()
    except Exception:  # noqa: BLE001 - best effort only
        pass

