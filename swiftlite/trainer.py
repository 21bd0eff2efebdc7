"""The Hugging Face Trainer, configured for SFT, plus the callbacks swiftlite adds:
logging.jsonl (loss, lr, grad_norm, tokens/s, memory), loss plots, and args.json in
every checkpoint so a checkpoint folder is self-describing."""
from __future__ import annotations

import json
import math
import os
import shutil
import time

from transformers import TrainerCallback

from .errors import RunError, UsageError
from .log import is_main_process


_USER_TB_DIR = os.environ.get("TENSORBOARD_LOGGING_DIR")  # a user's own choice wins

def collator(tokenizer, padding_free: bool):
    """Padding-free: a batch is one row of concatenated samples whose position_ids restart at 0
    for each sample; transformers then keeps attention inside each sample (SDPA or flash).
    Otherwise: right-padded to the longest sample, labels padded with -100."""
    if padding_free:
        from transformers import DataCollatorWithFlattening
        return DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)
    from transformers import DataCollatorForSeq2Seq
    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100,
                                  pad_to_multiple_of=None)


def trainer_class(chunked_loss: bool):
    """The HF Trainer, or a subclass whose training loss is swiftlite.loss.supervised_head_loss
    (LM head only at trained positions, chunked). Evaluation keeps the model's own loss."""
    from transformers import Trainer
    if not chunked_loss:
        return Trainer

    class SftTrainer(Trainer):
        _head_ok = None  # decided at the first step, once DeepSpeed has wrapped the model

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if self._head_ok is None:
                from .loss import why_unsupported
                reason = why_unsupported(model)
                if reason:
                    from .log import warn
                    warn(f"--chunked_loss: using the model's own loss because {reason}.")
                self._head_ok = reason is None
            if not (self._head_ok and model.training and not return_outputs
                    and "labels" in inputs and self.label_smoother is None):
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            from .loss import supervised_head_loss
            # Normalised like the model's own loss: by num_items_in_batch (trained tokens in
            # the whole accumulated batch) when the Trainer counts them, else a per-batch mean
            # that the Trainer divides by the accumulation steps.
            loss = supervised_head_loss(model, inputs, num_items_in_batch)
            if (self.args.average_tokens_across_devices and self.model_accepts_loss_kwargs
                    and num_items_in_batch is not None):  # as Trainer.compute_loss does
                loss = loss * (self.accelerator.num_processes // self.get_tp_size())
            return loss

    return SftTrainer


def peak_memory_mb() -> dict:
    import torch

    from .memory import peak_rss_bytes
    out = {"peak_rss_mb": round(peak_rss_bytes() / 2**20)}
    if torch.cuda.is_available():
        out["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated() / 2**20)
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
    """Stops on NaN/inf loss or gradient norm instead of training on garbage. build_trainer
    turns off the Trainer's logging_nan_inf_filter, which would otherwise log a NaN loss as
    the mean of earlier ones (0.0 at first); the gradient norm is checked as well because it
    turns NaN at the same step."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        for key in ("loss", "grad_norm"):
            value = (logs or {}).get(key)
            if value is not None and not math.isfinite(value):
                hint = ("fp16 overflows easily: use --torch_dtype bfloat16 (Ampere+ GPU) or "
                        "float32, or lower --learning_rate" if args.fp16 else
                        "lower --learning_rate (e.g. by 10x), keep --max_grad_norm on, or check "
                        "the data")
                what = "loss" if key == "loss" else "gradient norm"
                raise RunError(f"the {what} became {value} at step {state.global_step}; "
                               f"stopped instead of training on garbage. Try: {hint}.")


class CheckpointArgs(TrainerCallback):
    """Copies args.json into each checkpoint, so `infer`/`merge-lora` need only its path."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    def on_save(self, args, state, control, **kwargs):
        if not is_main_process():
            return
        ckpt = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        src = os.path.join(self.run_dir, "args.json")
        if os.path.isdir(ckpt) and os.path.exists(src):
            shutil.copy(src, os.path.join(ckpt, "args.json"))


def plot_losses(run_dir: str) -> list[str]:
    """images/train_loss.png (and eval_loss.png) from logging.jsonl."""
    path = os.path.join(run_dir, "logging.jsonl")
    if not os.path.exists(path):
        return []
    rows = [json.loads(line) for line in open(path)]
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = []
    for key, name in (("loss", "train_loss"), ("eval_loss", "eval_loss")):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if not pts:
            continue
        os.makedirs(os.path.join(run_dir, "images"), exist_ok=True)
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, linewidth=1.2, label=key)
        if len(pts) >= 10:  # a smoothed line makes the trend readable on noisy steps
            k = max(2, len(pts) // 10)
            sm = [sum(ys[max(0, i - k + 1):i + 1]) / len(ys[max(0, i - k + 1):i + 1])
                  for i in range(len(ys))]
            ax.plot(xs, sm, linewidth=2, label=f"{key} (moving mean of {k})")
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.set_title(f"{name} - {os.path.basename(run_dir)}")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        target = os.path.join(run_dir, "images", f"{name}.png")
        fig.savefig(target)
        plt.close(fig)
        out.append(target)
    return out


def build_trainer(model, tokenizer, train_ds, val_ds, args, run_dir: str, dtype: str, hw):
    """A transformers Trainer for these arguments and datasets."""
    from .distributed import world_size
    world = world_size()
    accum = args.gradient_accumulation_steps or max(
        1, 16 // (args.per_device_train_batch_size * world))
    extra = dict(args.training_args)
    extra.setdefault("report_to", ["tensorboard"])
    # transformers 5 reads the TensorBoard folder from the environment only. Set for every run
    # (not setdefault): a second run in one Python process must not log into the first's folder.
    os.environ["TENSORBOARD_LOGGING_DIR"] = _USER_TB_DIR or os.path.join(run_dir, "runs")
    extra.setdefault("include_num_input_tokens_seen",
                     "all" if args.padding_free else "non_padding")
    has_eval = val_ds is not None
    from .deepspeed import training_kwargs
    extra.update(training_kwargs(args, hw))
    extra.setdefault("eval_strategy", "steps" if has_eval else "no")
    extra.setdefault("logging_nan_inf_filter", False)  # NonFiniteLossGuard must see a NaN
    try:
        ta = _training_arguments(args, run_dir, accum, dtype, hw, extra)
    except ValueError as e:  # transformers' own consistency checks: a usage error, not a bug
        raise UsageError(f"transformers rejects these training arguments: {e}") from None
    _check_optimizer(ta, model)
    trainer_cls = trainer_class(args.chunked_loss)
    trainer = trainer_cls(model=model, args=ta, train_dataset=train_ds.remove_columns(["length"]),
                          eval_dataset=val_ds.remove_columns(["length"]) if has_eval else None,
                          data_collator=collator(tokenizer, args.padding_free),
                          processing_class=tokenizer,
                          callbacks=[JsonlLogger(os.path.join(run_dir, "logging.jsonl")),
                                     NonFiniteLossGuard(), CheckpointArgs(run_dir)])
    return trainer


def _training_arguments(args, run_dir: str, accum: int, dtype: str, hw, extra: dict):
    from transformers import TrainingArguments
    return TrainingArguments(
        output_dir=run_dir,
        num_train_epochs=args.num_train_epochs, max_steps=args.max_steps,
        per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=args.per_device_eval_batch_size,
        gradient_accumulation_steps=accum, learning_rate=args.learning_rate,
        lr_scheduler_type=args.lr_scheduler_type,
        # transformers 5 takes a warmup ratio as a float warmup_steps in [0, 1)
        warmup_steps=extra.pop("warmup_steps", args.warmup_ratio),
        weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
        logging_steps=args.logging_steps, save_steps=args.save_steps,
        eval_steps=args.eval_steps or args.save_steps, save_total_limit=args.save_total_limit,
        seed=args.seed, bf16=dtype == "bfloat16" and hw.device != "cpu",
        fp16=dtype == "float16", gradient_checkpointing=False,  # enabled in tuners.prepare_model
        remove_unused_columns=False,
        use_cpu=hw.device == "cpu", **extra)


def _check_optimizer(ta, model) -> None:
    """Resolve --optim now, before the run folder exists: an optimizer whose library is
    missing (adamw_bnb_8bit without bitsandbytes) otherwise fails only once training starts,
    with a traceback, leaving a run folder that never trained. A DeepSpeed config with its own
    optimizer (the offload presets) makes --optim unused: nothing to check."""
    if isinstance(ta.deepspeed, dict) and "optimizer" in ta.deepspeed:
        return
    from transformers import Trainer
    try:
        Trainer.get_optimizer_cls_and_kwargs(ta, model)
    except (ImportError, ValueError) as e:
        raise UsageError(f"--optim {ta.optim.value if hasattr(ta.optim, 'value') else ta.optim}:"
                         f" {e}") from None
