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
    """Stops on a NaN/inf loss, or gradient norm, instead of training on garbage. build_trainer
    turns off the Trainer's logging_nan_inf_filter, which would otherwise log a NaN loss as
    the mean of earlier ones (0.0 at first); the gradient norm is checked as well because it
    turns NaN at the same step. Under fp16 an inf gradient norm with a finite loss is the loss
    scaler at work (it skips that step and lowers the scale): counted and reported at the
    end, not stopped. The advice fits the hardware (bf16 only where it has bf16 units)."""

    def __init__(self, hw=None):
        self.hw, self.skipped = hw, 0

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
                raise RunError(f"the {what} became {value} at step {state.global_step}; "
                               f"stopped instead of training on garbage. Try: "
                               f"{self._hint(args)}.")

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


class CheckpointArgs(TrainerCallback):
    """Copies args.json into each checkpoint, so `infer`/`merge-lora` need only its path, then
    marks the checkpoint complete once every rank has written its part and all of it is on
    disk (runtime.output.mark_complete): a run killed while saving leaves a folder that is
    never resumed."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    def on_save(self, args, state, control, **kwargs):
        from swiftlite.runtime.distributed import barrier
        from swiftlite.runtime.output import mark_complete
        barrier()  # ZeRO: every rank's shards are written
        if is_main_process():
            ckpt = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            src = os.path.join(self.run_dir, "args.json")
            if os.path.isdir(ckpt):
                if os.path.exists(src):
                    shutil.copy(src, os.path.join(ckpt, "args.json"))
                mark_complete(ckpt, state.global_step)
        barrier()
