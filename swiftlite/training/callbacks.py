"""The callbacks swiftlite adds to the Trainer: logging.jsonl (loss, lr, grad_norm, tokens/s,
memory), a stop on a non-finite loss, and args.json in every checkpoint so a checkpoint
folder is self-describing."""
from __future__ import annotations

import json
import math
import os
import shutil
import time

from transformers import TrainerCallback

from swiftlite.errors import RunError
from swiftlite.log import is_main_process


def peak_memory_mb() -> dict:
    from swiftlite.runtime.allocator import peak_rss_bytes
    from swiftlite.runtime.hardware import accelerator
    out = {"peak_rss_mb": round(peak_rss_bytes() / 2**20)}
    device = accelerator()  # "gpu" for CUDA and NPU alike: one column for plots and readers
    if device is not None:
        out["peak_gpu_mb"] = round(device.max_memory_allocated() / 2**20)
    return out


class JsonlLogger(TrainerCallback):
    """One JSON object per logging step in logging.jsonl, with throughput and memory."""

    def __init__(self, path: str):
        self.path = path
        self._t = self._tokens = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._t, self._tokens = time.time(), state.num_input_tokens_seen

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not is_main_process() or not logs:
            return
        row = {"step": state.global_step, "max_steps": state.max_steps, **logs}
        now, tokens = time.time(), state.num_input_tokens_seen
        if "loss" in logs and self._t is not None and tokens:
            row["tokens_per_s"] = round((tokens - self._tokens) / max(now - self._t, 1e-9), 1)
            self._t, self._tokens = now, tokens
        row.update(peak_memory_mb())
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


class NonFiniteLossGuard(TrainerCallback):
    """Stops on a NaN/inf loss, or gradient norm, instead of training on garbage, and before
    a checkpoint of non-finite weights is saved. Every micro-batch's loss is recorded on its
    device by the trainer (see()): no synchronisation. It is read back after every optimizer
    step of a single process (the Trainer has already synchronised the device by then, counting
    tokens), unless the step logs (on_log sees its loss, once it is in logging.jsonl); by every
    rank together (an all-reduce, so that all ranks stop at the same step) before each save, and
    through the logged loss (a mean over ranks). A save is preceded by a check of the trainable
    weights themselves as well: an update can make them non-finite after a finite loss.
    build_trainer turns off the Trainer's logging_nan_inf_filter, which would otherwise log a
    NaN loss as the mean of earlier ones (0.0 at first); the gradient norm is checked as well
    because it turns NaN at the same step. Under fp16 an inf gradient norm with a finite loss
    is the loss scaler at work (it skips that step and lowers the scale): counted and reported
    at the end, not stopped. The advice fits the hardware (bf16 only where it has bf16 units)."""

    NONE = 2**62  # no non-finite loss seen

    def __init__(self, hw=None):
        self.hw, self.skipped = hw, 0
        self._first = self._value = None  # device tensors: the first bad step and its loss

    def see(self, loss, step: int) -> None:
        """A micro-batch's loss (of optimizer step `step`): device operations only."""
        import torch
        loss = loss.detach().float()
        if self._first is None:
            self._first = torch.full((), self.NONE, dtype=torch.int64, device=loss.device)
            self._value = torch.zeros((), device=loss.device)
        new = ~torch.isfinite(loss).all() & (self._first == self.NONE)
        self._first = torch.where(new, step, self._first)
        self._value = torch.where(new, loss.reshape(-1)[0], self._value)

    def on_step_end(self, args, state, control, **kwargs):
        from swiftlite.runtime.distributed import world_size
        if world_size() == 1 and not control.should_log:  # a logged step: on_log sees it
            self._check_loss(args, state)

    def before_save(self, args, state, model) -> None:
        """Called by every rank just before a checkpoint is written (the trainer's
        _save_checkpoint): no checkpoint of a run whose loss or weights are not finite."""
        self._check_loss(args, state)
        if not _finite_weights(model):
            self._stop(args, state, f"the weights became non-finite at step "
                       f"{state.global_step} (before checkpoint-{state.global_step} was saved)")

    def _check_loss(self, args, state) -> None:
        from swiftlite.runtime.distributed import all_ranks_min, world_size
        if self._first is None:
            return
        first = int(all_ranks_min(self._first).item())
        if first != self.NONE:
            value = float(self._value.item()) if world_size() == 1 else "non-finite"
            self._stop(args, state, f"the loss became {value} at step {first}")

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        loss, norm = logs.get("loss"), logs.get("grad_norm")
        if args.fp16 and norm is not None and not math.isfinite(norm) and (
                loss is None or math.isfinite(loss)):
            self.skipped += 1  # GradScaler: overflow, step skipped, scale halved
            return
        for key, value in (("loss", loss), ("grad_norm", norm)):
            if value is not None and not math.isfinite(value):
                what = "loss" if key == "loss" else "gradient norm"
                self._stop(args, state, f"the {what} became {value} at step {state.global_step}")

    def _stop(self, args, state, what: str):
        raise RunError(f"{what}; stopped instead of training on garbage ({_last_words(args)}). "
                       f"Try: {self._hint(args)}.")

    def on_train_end(self, args, state, control, **kwargs):
        if self.skipped:
            from swiftlite.log import info
            info(f"fp16: the loss scaler skipped {self.skipped} logged step(s) whose gradients "
                 "overflowed (normal in the first steps while it finds its scale)")

    def _hint(self, args) -> str:
        if not args.fp16:
            return ("lower --learning_rate (e.g. by 10x), keep --max_grad_norm on, or check "
                    "the data")
        from swiftlite.runtime.hardware import has_bf16
        wider = ("--torch_dtype bfloat16 (same speed, no overflow)" if self.hw is not None
                 and has_bf16(self.hw) else "--torch_dtype float32 (this device has no bf16)")
        return f"fp16 overflows easily: use {wider}, or lower --learning_rate"


def _last_words(args) -> str:
    from swiftlite.runtime.output import last_checkpoint
    last = last_checkpoint(getattr(args, "output_dir", None) or "")
    return f"the last complete checkpoint is {last}" if last else "no complete checkpoint"


def _finite_weights(model) -> bool:
    """Whether every trainable weight is finite, on every rank (ZeRO-3: each rank's part):
    one flag per tensor on its device, one read back."""
    import torch

    from swiftlite.runtime.distributed import all_ranks_min
    flags = [torch.isfinite(getattr(p, "ds_tensor", p).detach()).all()
             for p in model.parameters() if p.requires_grad]
    if not flags:
        return True
    device = flags[0].device
    ok = torch.stack([f.to(device) for f in flags]).all().to(torch.int64)
    return bool(all_ranks_min(ok).item())


class CheckpointArgs(TrainerCallback):
    """Copies args.json into each checkpoint, so `infer`/`merge-lora` need only its path, then
    marks the checkpoint complete once every rank has written its part and all of it is on
    disk (runtime.output.mark_complete): a run killed while saving leaves a folder that is
    never resumed."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    def on_save(self, args, state, control, **kwargs):
        from swiftlite.runtime.distributed import barrier, from_main
        from swiftlite.runtime.output import mark_complete
        barrier()  # ZeRO: every rank's shards are written
        problem = None
        if is_main_process():
            ckpt = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            src = os.path.join(self.run_dir, "args.json")
            if os.path.isdir(ckpt):
                if os.path.exists(src):
                    shutil.copy(src, os.path.join(ckpt, "args.json"))
                problem = adapter_problem(ckpt)
                if problem is None:
                    mark_complete(ckpt, state.global_step)
        problem = from_main(problem)  # also the second barrier: the checkpoint is marked
        if problem:
            raise RunError(f"{problem[0]}: it is not marked complete and is never resumed; "
                           f"stopped ({_last_words(args)}). {problem[1]}")


ADAPTER_FILE = "adapter_model.safetensors"


def adapter_problem(ckpt: str) -> tuple[str, str] | None:
    """(what is wrong with a saved adapter, what to try), or None (all finite and whole, or no
    adapter). An empty tensor is a ZeRO-3 partition saved where the gathered weight belongs.
    Full weights are checked in memory before they are saved (NonFiniteLossGuard)."""
    path = os.path.join(ckpt, ADAPTER_FILE)
    if not os.path.exists(path):
        return None
    import torch
    from safetensors import safe_open
    bad, empty = 0, []
    with safe_open(path, framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            bad += int((~torch.isfinite(t)).sum())
            if t.numel() == 0:
                empty.append(name)
    if empty:
        return (f"{path} holds {len(empty)} empty tensor(s) ({empty[0]}, ...): the ZeRO-3 "
                "partitions, not the gathered weights", "Try: a DeepSpeed config with "
                "stage3_gather_16bit_weights_on_model_save true (swiftlite's zero3 presets), "
                "or zero2.")
    if bad:
        return f"{path} holds {bad:,} non-finite values", "Try: lower --learning_rate."
    return None
