"""Arguments of `swiftlite rlhf`: everything `swiftlite sft` takes, plus the preference group
(the method, its loss and their weights; names and defaults as ms-swift's and TRL's)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from swiftlite.config.fields import arg
from swiftlite.config.sft_args import SftArguments

# rlhf_type -> its loss types, the first the default (as TRL 1.16 names them)
LOSS_TYPES = {
    "dpo": ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair",
            "sppo_hard", "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop",
            "sigmoid_norm"),
    "cpo": ("sigmoid", "hinge", "ipo"),
    "simpo": ("simpo",),
    "orpo": ("orpo",),
    "kto": ("kto", "apo_zero_unpaired"),
}
DEFAULT_BETA = {"dpo": 0.1, "cpo": 0.1, "simpo": 2.0, "orpo": 0.1, "kto": 0.1}
NEEDS_REFERENCE = ("dpo", "kto")  # CPO, SimPO and ORPO compare the policy with itself
# the (method, loss) pairs whose loss reads --label_smoothing (TRL 1.16's)
SMOOTHED = {("dpo", "robust"), ("dpo", "exo_pair"), ("dpo", "aot"), ("dpo", "aot_unpaired"),
            ("cpo", "sigmoid"), ("simpo", "simpo")}


@dataclass
class PreferenceArguments:
    rlhf_type: str = arg("dpo", "the method: dpo, orpo, simpo, cpo (pairs) or kto (rows "
                         "labelled desirable or not; pairs are split into both)",
                         choices=tuple(LOSS_TYPES), group="rlhf")
    loss_type: Optional[str] = arg(None, "the method's loss (default: its first): dpo: "
                                   + ", ".join(LOSS_TYPES["dpo"]) + "; cpo: sigmoid, hinge, "
                                   "ipo; kto: kto, apo_zero_unpaired", group="rlhf")
    beta: Optional[float] = arg(None, "how far the policy may move from the reference (ORPO: "
                                "the odds-ratio weight); default 0.1, SimPO 2.0", group="rlhf")
    label_smoothing: float = arg(0.0, "share of pairs assumed mislabelled (dpo robust, "
                                 "exo_pair, aot; cpo, simpo)", group="rlhf")
    rpo_alpha: Optional[float] = arg(None, "dpo: add this times the SFT loss on the chosen "
                                     "replies (RPO)", group="rlhf")
    simpo_gamma: float = arg(1.0, "simpo: the target reward margin", group="rlhf")
    cpo_alpha: float = arg(1.0, "cpo: weight of the SFT loss on the chosen replies",
                           group="rlhf")
    desirable_weight: float = arg(1.0, "kto: weight of the desirable rows' loss", group="rlhf")
    undesirable_weight: float = arg(1.0, "kto: weight of the undesirable rows' loss",
                                    group="rlhf")
    precompute_ref_log_probs: bool = arg(False, "dpo: compute the reference log-probs once "
                                         "before training (cached with the encoded data), so "
                                         "each step runs the policy alone", group="rlhf")
    adapters: list[str] = arg(help="a LoRA checkpoint (e.g. from swiftlite sft) whose adapters "
                              "go on training; it is also the reference", factory=list,
                              group="rlhf")

    def resolved_loss_type(self) -> str:
        return self.loss_type or LOSS_TYPES[self.rlhf_type][0]

    def resolved_beta(self) -> float:
        return DEFAULT_BETA[self.rlhf_type] if self.beta is None else self.beta


@dataclass
class RlhfArguments(SftArguments, PreferenceArguments):
    """Arguments of `swiftlite rlhf`."""

    def validate(self) -> "RlhfArguments":
        super().validate()
        if self.rlhf_type == "kto" and self.per_device_eval_batch_size < 2:
            # KTO's KL estimate pairs each prompt with another row's completion in the batch:
            # in a batch of one it would pair the row with itself
            from swiftlite.log import info
            info(f"kto: --per_device_eval_batch_size {self.per_device_eval_batch_size} -> "
                 f"{self.per_device_train_batch_size} (the training batch: the KL estimate "
                 "pairs each prompt with another row's completion)")
            self.per_device_eval_batch_size = self.per_device_train_batch_size
        return self

    def problems(self) -> list[str]:
        problems = super().problems()
        if self.eval_generate:
            problems.append("--eval_generate scores answers to SFT rows; for preference pairs "
                            "the eval step already logs rewards/accuracies (use "
                            "--metric_for_best_model rewards/accuracies with "
                            "--early_stopping_patience), or run swiftlite eval on the checkpoint")
        if self.rlhf_type in LOSS_TYPES:
            problems += self._preference_problems()
        return problems

    def _adapter_problems(self) -> list[str]:
        """--adapters goes on training a checkpoint's adapters as they are: the flags that
        shape new adapters would be recorded and ignored."""
        if not self.adapters:
            return []
        import dataclasses
        shaping = ("lora_rank", "lora_alpha", "target_modules", "use_dora", "use_rslora",
                   "init_lora_weights", "modules_to_save", "lora_bias")
        fields = {f.name: f for f in dataclasses.fields(self)}
        given = [f"--{n}" for n in shaping if getattr(self, n) != (
            fields[n].default if fields[n].default is not dataclasses.MISSING
            else fields[n].default_factory())]
        if not given:
            return []
        return [f"--adapters continues the adapters of {self.adapters[0]} as they were trained "
                f"(their rank, targets and variant are in its adapter_config.json): drop "
                f"{', '.join(given)}"]

    def _unused_setting_problems(self) -> list[str]:
        """A method's own setting given to another: recorded in args.json, read by nothing."""
        problems, kind, loss = [], self.rlhf_type, self.resolved_loss_type()
        if self.label_smoothing and (kind, loss) not in SMOOTHED:
            problems.append(f"--label_smoothing with --rlhf_type {kind} --loss_type {loss}: that "
                            "loss has no label smoothing (dpo's robust, exo_pair, aot, "
                            "aot_unpaired and cpo/simpo's sigmoid and simpo have)")
        for flag, default, owner, name in (("simpo_gamma", 1.0, "simpo", "SimPO"),
                                           ("cpo_alpha", 1.0, "cpo", "CPO"),
                                           ("desirable_weight", 1.0, "kto", "KTO"),
                                           ("undesirable_weight", 1.0, "kto", "KTO")):
            if getattr(self, flag) != default and kind != owner:
                problems.append(f"--{flag} is {name}'s (--rlhf_type {owner}); --rlhf_type "
                                f"{kind} does not read it")
        return problems

    def _preference_problems(self) -> list[str]:
        problems, kind = [], self.rlhf_type
        if self.loss_type is not None and self.loss_type not in LOSS_TYPES[kind]:
            problems.append(f"--loss_type {self.loss_type} with --rlhf_type {kind}: choose one "
                            f"of {', '.join(LOSS_TYPES[kind])}")
        if self.resolved_beta() <= 0:
            problems.append(f"--beta must be positive, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            problems.append(f"--label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.resolved_loss_type() == "exo_pair" and self.label_smoothing <= 0:
            problems.append("--loss_type exo_pair needs --label_smoothing above 0 (its epsilon, "
                            "e.g. 0.001)")
        problems += self._unused_setting_problems()
        if self.rpo_alpha is not None and kind != "dpo":
            problems.append(f"--rpo_alpha is DPO's; --rlhf_type {kind} has its own SFT term"
                            + (" (--cpo_alpha)" if kind == "cpo" else ""))
        if kind == "kto" and self.per_device_train_batch_size < 2:
            problems.append("--rlhf_type kto needs --per_device_train_batch_size 2 or more: its "
                            "KL estimate pairs each prompt with another row's completion in "
                            "the batch")
        if kind == "kto" and (self.precompute_ref_log_probs or self.adapters):
            problems.append("--rlhf_type kto computes its reference with each batch (its KL "
                            "pairs change with the batch): drop --precompute_ref_log_probs / "
                            "--adapters, or use dpo")
        if kind == "kto" and self.train_type == "full":
            problems.append("--rlhf_type kto with --train_type full: KTO's reference is the "
                            "model with its LoRA adapters switched off, computed with each batch; "
                            "use --train_type lora")
        if kind == "kto" and self.mutated_init:
            problems.append(f"--init_lora_weights {self.init_lora_weights} with --rlhf_type kto: "
                            "KTO's reference is the model with its adapters off, which PiSSA/"
                            "OLoRA leave as a residual of the base; use true or gaussian")
        if kind not in NEEDS_REFERENCE and self.precompute_ref_log_probs:
            problems.append(f"--precompute_ref_log_probs: --rlhf_type {kind} has no reference "
                            "model")
        if len(self.adapters) > 1:
            problems.append("--adapters takes one LoRA checkpoint")
        for a in self.adapters:
            if not os.path.isfile(os.path.join(a, "adapter_config.json")):
                problems.append(f"--adapters {a}: not a LoRA checkpoint (no adapter_config.json)")
        problems += self._adapter_problems()
        if self.adapters and self.train_type != "lora":
            problems.append("--adapters continues LoRA adapters: --train_type lora")
        if self.packing:
            problems.append("--packing packs SFT samples; preference batches are already "
                            "padding-free (chosen and rejected in one row): drop --packing")
        if self.streaming and (self.precompute_ref_log_probs or self.adapters
                               or self.train_type == "full"):
            problems.append("--streaming with a precomputed reference (--precompute_ref_log_probs"
                            ", --adapters or --train_type full): it is computed over every pair "
                            "before training; drop --streaming")
        if self.loss_scale != "default":
            problems.append("--loss_scale: preference training trains the last reply only")
        return problems
