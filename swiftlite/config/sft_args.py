"""Arguments of `swiftlite sft`: the model, data, tuner and training groups, plus every other
transformers TrainingArguments field as a flag of the same name (in `training_args`)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from swiftlite.config.constants import DEFAULT_TOTAL_BATCH
from swiftlite.config.data_args import DataArguments
from swiftlite.config.fields import arg, check_choices, not_finite, not_positive, raise_if
from swiftlite.config.model_args import ModelArguments
from swiftlite.config.train_args import TrainArguments
from swiftlite.config.tuner_args import LoraArguments

QUANT_ZERO3 = ("ZeRO-3 partitions the base weights, and bitsandbytes' packed 4/8-bit weights "
               "cannot be partitioned; use zero2 (or zero2_offload), which shards only the LoRA "
               "weights' optimizer state")


@dataclass
class SftArguments(ModelArguments, DataArguments, LoraArguments, TrainArguments):
    """Arguments of `swiftlite sft`."""
    training_args: dict = arg(help="other transformers TrainingArguments fields",
                              factory=dict, group="hidden")

    def accumulation_steps(self, world_size: int) -> int:
        """--gradient_accumulation_steps, or as many as make the default total batch."""
        return self.gradient_accumulation_steps or max(
            1, DEFAULT_TOTAL_BATCH // (self.per_device_train_batch_size * world_size))

    def validate(self) -> "SftArguments":
        raise_if(self.problems())
        return self

    def problems(self) -> list[str]:
        """Every problem of these arguments, one sentence each."""
        problems = []
        if not self.model:
            problems.append("--model is required (an alias such as SmolLM2-135M-Instruct, a hub "
                            "id, or a local folder)")
        if not self.dataset:
            problems.append("--dataset is required (a file, or a built-in such as "
                            "self-cognition#500)")
        problems += check_choices(self) + not_finite(self)
        if self.dataset_num_proc is not None and self.dataset_num_proc < 1:
            problems.append(f"--dataset_num_proc must be at least 1, got {self.dataset_num_proc}")
        problems += not_positive(self, ("lora_rank", "lora_alpha", "max_length",
                                         "per_device_train_batch_size",
                                         "per_device_eval_batch_size", "logging_steps",
                                         "save_steps"))
        for name in ("seed", "data_seed"):  # numpy's seeding takes 0 .. 2**32 - 1
            if not 0 <= getattr(self, name) < 2 ** 32:
                problems.append(f"--{name} must be in 0 .. 4294967295, got {getattr(self, name)}")
        if self.batch_threads is not None and self.batch_threads < 1:
            problems.append(f"--batch_threads must be at least 1, got {self.batch_threads}")
        if self.gradient_accumulation_steps is not None and self.gradient_accumulation_steps < 1:
            problems.append("--gradient_accumulation_steps must be at least 1")
        if not 0 <= self.split_dataset_ratio < 1:
            problems.append(f"--split_dataset_ratio must be in [0, 1), got "
                            f"{self.split_dataset_ratio}")
        if self.split_dataset_ratio and self.val_dataset:
            problems.append("give --val_dataset or --split_dataset_ratio, not both")
        evaluate = self.training_args.get("eval_strategy", "no")
        evaluate = "no" if evaluate is False else str(evaluate).lower()  # YAML reads no as False
        if evaluate not in ("no", "intervalstrategy.no") and not (
                self.val_dataset or self.split_dataset_ratio):
            problems.append(f"--eval_strategy {self.training_args['eval_strategy']} needs data "
                            "to evaluate on: add --val_dataset FILE or --split_dataset_ratio 0.05")
        for flag in ("early_stopping_patience", "eval_generate"):
            if getattr(self, flag) and not (self.val_dataset or self.split_dataset_ratio):
                problems.append(f"--{flag} needs data to evaluate on: add --val_dataset FILE or "
                                "--split_dataset_ratio 0.05")
        if self.early_stopping_patience is not None and self.early_stopping_patience < 1:
            problems.append(f"--early_stopping_patience must be at least 1, got "
                            f"{self.early_stopping_patience}")
        if not 0 <= self.lora_dropout < 1:
            problems.append(f"--lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.learning_rate <= 0:
            problems.append(f"--learning_rate must be positive, got {self.learning_rate}")
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            problems.append("set --max_steps or --num_train_epochs to a positive number")
        problems += self._data_mode_problems()
        if self.resume_from_checkpoint and not os.path.isdir(self.resume_from_checkpoint):
            problems.append(f"--resume_from_checkpoint {self.resume_from_checkpoint}: no such "
                            "folder")
        problems += self.quant_problems() + self.lora_variant_problems()
        if self.quant_bits is not None and self.train_type != "lora":
            problems.append(f"--quant_bits {self.quant_bits} with --train_type "
                            f"{self.train_type}: a quantized base cannot be trained itself; "
                            "train LoRA adapters on it (--train_type lora)")
        if self.quant_bits is not None and "zero3" in str(self.deepspeed or ""):
            # a preset, caught here for the Web-UI's form; any ZeRO-3 config: sft's preflight
            problems.append(f"--quant_bits with --deepspeed {self.deepspeed}: {QUANT_ZERO3}")
        return problems

    def _data_mode_problems(self) -> list[str]:
        problems = []
        if self.streaming and self.max_steps <= 0:
            problems.append("--streaming true needs --max_steps N: a stream has no length to "
                            "count epochs in")
        if self.streaming and self.split_dataset_ratio:
            problems.append("--split_dataset_ratio with --streaming true: a held-out share "
                            "needs every row first; give --val_dataset FILE instead")
        if self.streaming and self.packing:
            problems.append("--packing with --streaming true: packing is planned over every "
                            "sample's length; use one of them")
        if self.packing and not self.padding_free:
            problems.append("--packing true keeps samples apart the way padding-free batches "
                            "do (position ids): drop --padding_free false")
        if self.shuffle_buffer_size < 1:
            problems.append(f"--shuffle_buffer_size must be at least 1, got "
                            f"{self.shuffle_buffer_size}")
        return problems
