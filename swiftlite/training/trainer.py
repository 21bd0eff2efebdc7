"""The Hugging Face Trainer, configured for SFT: the collator, the chunked-loss subclass, and
the TrainingArguments built from SftArguments (fields of the same name and meaning are
forwarded as they are; the few that need translating are listed in TRANSLATED)."""
from __future__ import annotations

import os

from swiftlite.config.constants import IGNORE_INDEX
from swiftlite.errors import UsageError
from swiftlite.training.callbacks import CheckpointArgs, JsonlLogger, NonFiniteLossGuard


_USER_TB_DIR = os.environ.get("TENSORBOARD_LOGGING_DIR")  # a user's own choice wins

def collator(tokenizer, padding_free: bool, packed: bool = False):
    """Padding-free: a batch is one row of concatenated samples whose position_ids restart at 0
    for each sample; transformers then keeps attention inside each sample (SDPA or flash).
    Packed rows (data.packing) are concatenated the same way. Otherwise: right-padded to the
    longest sample, labels padded with -100."""
    if packed:
        from swiftlite.data.packing import collate
        return collate
    if padding_free:
        from transformers import DataCollatorWithFlattening
        return DataCollatorWithFlattening(return_position_ids=True, separator_id=IGNORE_INDEX)
    from transformers import DataCollatorForSeq2Seq
    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX,
                                  pad_to_multiple_of=None)


def trainer_class(chunked_loss: bool):
    """The HF Trainer, or a subclass whose training loss is
    swiftlite.training.speedups.chunked_loss.supervised_head_loss
    (LM head only at trained positions, chunked). Evaluation keeps the model's own loss."""
    from transformers import Trainer

    class NoSecretsTrainer(Trainer):
        lora_plus_lr_ratio = None  # --lora_plus_lr_ratio, set by build_trainer
        batch_threads = 1  # --batch_threads as decided for this model, set by build_trainer

        def create_optimizer(self, model=None):
            if self.lora_plus_lr_ratio and self.optimizer is None:
                from swiftlite.training.lora_variants import loraplus_optimizer
                self.optimizer = loraplus_optimizer(model or self.model, self.args,
                                                    self.lora_plus_lr_ratio)
            return super().create_optimizer(model)

        def training_step(self, model, inputs, num_items_in_batch=None):
            if self.batch_threads > 1:
                loss = self._threaded_step(model, inputs, num_items_in_batch)
            else:
                loss = super().training_step(model, inputs, num_items_in_batch)
            for guard in self._guards():  # every loss seen, not only logged ones
                guard.see(loss, self.state.global_step + 1)
            self.trained_a_step = True  # a run that fails from now on keeps its folder
            return loss

        def _threaded_step(self, model, inputs, num_items_in_batch):
            """The step's samples in threads (speedups/batch_threads.py). Each part's loss is
            normalised by the whole batch's trained tokens (num_items_in_batch), so the parts'
            gradients and losses add up to the batch's; without that count the batch runs whole,
            in one part."""
            from swiftlite.training.speedups.batch_threads import train_step
            return train_step(
                lambda part: Trainer.training_step(self, model, part, num_items_in_batch),
                inputs, self.batch_threads if num_items_in_batch is not None else 1)

        def _save_checkpoint(self, model, trial):
            for guard in self._guards():
                guard.before_save(self.args, self.state, self.model)
            return super()._save_checkpoint(model, trial)

        def _guards(self):
            return [cb for cb in self.callback_handler.callbacks
                    if isinstance(cb, NonFiniteLossGuard)]

        def _save(self, output_dir=None, state_dict=None):
            # training_args.bin is the pickled TrainingArguments: write it without the secrets
            # (hub_token, ...), which stay set for pushing to the hub.
            import dataclasses

            from swiftlite.config.secrets import is_secret
            kept = {f.name: getattr(self.args, f.name) for f in dataclasses.fields(self.args)
                    if is_secret(f.name) and getattr(self.args, f.name)}
            for name in kept:
                object.__setattr__(self.args, name, None)
            try:
                super()._save(output_dir, state_dict)
                if self.processing_class is not None and self.args.should_save:
                    from swiftlite.models.loader import list_added_tokens
                    list_added_tokens(self.processing_class, output_dir or self.args.output_dir)
            finally:
                for name, value in kept.items():
                    object.__setattr__(self.args, name, value)

    if not chunked_loss:
        return NoSecretsTrainer

    class SftTrainer(NoSecretsTrainer):
        _head_ok = None  # decided at the first step, once DeepSpeed has wrapped the model

        def _threaded_step(self, model, inputs, num_items_in_batch):
            self._decide_head(model)  # here, not in each part's thread: one decision, one warning
            return super()._threaded_step(model, inputs, num_items_in_batch)

        def _decide_head(self, model):
            if self._head_ok is None:
                from swiftlite.training.speedups.chunked_loss import why_unsupported
                reason = why_unsupported(model)
                if reason:
                    from swiftlite.log import warn
                    warn(f"--chunked_loss: using the model's own loss because {reason}.")
                self._head_ok = reason is None

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self._decide_head(model)
            if not (self._head_ok and model.training and not return_outputs
                    and "labels" in inputs and self.label_smoother is None):
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            from swiftlite.training.speedups.chunked_loss import supervised_head_loss
            # Normalised like the model's own loss: by num_items_in_batch (trained tokens in
            # the whole accumulated batch) when the Trainer counts them, else a per-batch mean
            # that the Trainer divides by the accumulation steps.
            loss = supervised_head_loss(model, inputs, num_items_in_batch)
            if (self.args.average_tokens_across_devices and self.model_accepts_loss_kwargs
                    and num_items_in_batch is not None):  # as Trainer.compute_loss does
                loss = loss * (self.accelerator.num_processes // self.get_tp_size())
            return loss

    return SftTrainer


def build_trainer(model, tokenizer, train_ds, val_ds, args, run_dir: str, dtype: str, hw,
                  trainer_cls=None, data_collator=None, **trainer_kwargs):
    """A transformers Trainer for these arguments and datasets: SFT's (chunked loss, its
    collator) unless another method gives its trainer class, collator and their arguments."""
    from swiftlite.runtime.distributed import world_size
    world = world_size()
    accum = args.accumulation_steps(world)
    extra = dict(args.training_args)
    extra.setdefault("report_to", ["tensorboard"])
    # transformers 5 reads the TensorBoard folder from the environment only. Set for every run
    # (not setdefault): a second run in one Python process must not log into the first's folder.
    os.environ["TENSORBOARD_LOGGING_DIR"] = _USER_TB_DIR or os.path.join(run_dir, "runs")
    extra.setdefault("include_num_input_tokens_seen",
                     "all" if args.padding_free else "non_padding")
    has_eval = val_ds is not None
    from swiftlite.training.deepspeed import training_kwargs
    extra.update(training_kwargs(args, hw))
    extra.setdefault("eval_strategy", "steps" if has_eval else "no")
    if data_collator is not None and not hasattr(train_ds, "__len__"):
        # A stream's batches are split by their first dimension when accelerate dispatches
        # them from one process; a preference batch's tensors have different first
        # dimensions (one padding-free row, a label per row), so each process reads its own.
        extra["accelerator_config"] = {**extra.get("accelerator_config", {}),
                                       "dispatch_batches": False}
    extra.setdefault("logging_nan_inf_filter", False)  # NonFiniteLossGuard must see a NaN
    if args.early_stopping_patience:
        extra.setdefault("metric_for_best_model", "eval_loss")
    try:
        ta = _training_arguments(args, run_dir, accum, dtype, hw, extra)
    except ValueError as e:  # transformers' own consistency checks: a usage error, not a bug
        raise UsageError(f"transformers rejects these training arguments: {e}") from None
    _check_optimizer(ta, model)
    one_device(ta, world)
    sft = trainer_cls is None
    trainer_cls = trainer_cls or trainer_class(args.chunked_loss)
    if data_collator is None:
        from swiftlite.data.packing import PackedDataset
        data_collator = collator(tokenizer, args.padding_free, isinstance(train_ds, PackedDataset))
    callbacks = [JsonlLogger(os.path.join(run_dir, "logging.jsonl")), NonFiniteLossGuard(hw),
                 CheckpointArgs(run_dir)]
    scorer = None
    if has_eval and args.eval_generate:  # before early stopping: it may watch these figures
        from swiftlite.training.eval_generate import GenerationMetrics
        scorer = GenerationMetrics(val_ds, tokenizer, args.eval_max_new_tokens,
                                   args.per_device_eval_batch_size)
        callbacks.append(scorer)
    if args.early_stopping_patience:
        from transformers import EarlyStoppingCallback
        callbacks.append(EarlyStoppingCallback(args.early_stopping_patience))
    trainer = trainer_cls(model=model, args=ta, train_dataset=_without_length(train_ds),
                          eval_dataset=_without_length(val_ds) if has_eval else None,
                          data_collator=data_collator, processing_class=tokenizer,
                          callbacks=callbacks, **trainer_kwargs)
    if scorer is not None:
        scorer.trainer = trainer
    trainer.lora_plus_lr_ratio = getattr(args, "lora_plus_lr_ratio", None)
    if sft:
        from swiftlite.training.speedups.batch_threads import threads
        trainer.batch_threads = threads(model, args, hw.device)
        if trainer.batch_threads > 1:
            from swiftlite.log import info
            info(f"batch threads: each batch's samples train in {trainer.batch_threads} "
                 "threads, each on a share of the cores (--batch_threads 1: off)")
    return trainer


def _without_length(ds):
    """The dataset without the encoded "length" column (a stream or packed rows have none)."""
    return ds.remove_columns(["length"]) if "length" in (getattr(
        ds, "column_names", None) or []) else ds


# SftArguments fields that TrainingArguments has too but that are not passed as they are:
# swiftlite translates them (below) or uses them itself.
TRANSLATED = {
    "output_dir": "the run folder <output_dir>/v<N>-<timestamp> is passed",
    "gradient_accumulation_steps": "unset: the default total batch (SftArguments.accumulation_steps)",
    "eval_steps": "unset: --save_steps",
    "gradient_checkpointing": "enabled on the model by training.tuners (non-reentrant)",
    "deepspeed": "a preset name or auto, resolved to a config by training.deepspeed",
    "resume_from_checkpoint": "passed to Trainer.train",
    "data_seed": "seeds swiftlite's #N sampling and split, not the Trainer's sampler",
}


def forwarded_fields(args) -> dict:
    """The SftArguments fields that are TrainingArguments fields of the same name and meaning."""
    import dataclasses

    from transformers import TrainingArguments
    names = {f.name for f in dataclasses.fields(TrainingArguments)} - set(TRANSLATED)
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name in names}


def _training_arguments(args, run_dir: str, accum: int, dtype: str, hw, extra: dict):
    from transformers import TrainingArguments

    from swiftlite.runtime.hardware import amp_flags, weights_dtype
    weights = weights_dtype(dtype, args.train_type, "deepspeed" in extra)
    return TrainingArguments(
        **forwarded_fields(args), output_dir=run_dir, gradient_accumulation_steps=accum,
        # transformers 5 takes a warmup ratio as a float warmup_steps in [0, 1)
        warmup_steps=extra.pop("warmup_steps", args.warmup_ratio),
        eval_steps=args.eval_steps or args.save_steps,
        gradient_checkpointing=False, remove_unused_columns=False,
        use_cpu=hw.device == "cpu", **amp_flags(dtype, hw, weights), **extra)


def one_device(ta, world: int) -> None:
    """One process that sees several GPUs trains on one of them. The Trainer would wrap the
    model in nn.DataParallel, which splits each batch along its first dimension: a
    padding-free batch is one row, so GPU 0 would get every token, and the chunked loss's
    head hook does not survive the replicas. Several GPUs are used by several processes."""
    if world == 1 and ta.n_gpu > 1:
        from swiftlite.log import warn
        warn(f"{ta.n_gpu} GPUs are visible to one process: training on one. Set "
             f"NPROC_PER_NODE={ta.n_gpu} to train on all of them (DDP, or --deepspeed).")
        object.__setattr__(ta, "_n_gpu", 1)


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
