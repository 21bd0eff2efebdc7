"""The tuner group: LoRA (and its variants, all peft's or transformers') or full fine-tuning."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from swiftlite.config.fields import arg

INIT_LORA_WEIGHTS = ("true", "gaussian", "pissa", "pissa_niter_N", "olora", "loftq")
MUTATED_INIT = ("pissa", "olora")  # inits that move part of the base weights into the adapter


def init_problems(init: str) -> list[str]:
    """--init_lora_weights' value checked (sft, rlhf and estimate alike)."""
    if re.fullmatch(r"true|gaussian|pissa|pissa_niter_[1-9]\d*|olora|loftq", init):
        return []
    return [f"--init_lora_weights {init}: choose one of {', '.join(INIT_LORA_WEIGHTS)} (N a "
            "positive number)"]


@dataclass
class LoraArguments:
    train_type: str = arg("lora", "lora: train adapters on a frozen model; full: all weights",
                          choices=("lora", "full"), group="tuner")
    lora_rank: int = arg(8, "LoRA rank r", group="tuner")
    lora_alpha: int = arg(32, "LoRA alpha (scale = alpha / rank)", group="tuner")
    lora_dropout: float = arg(0.05, "dropout on the LoRA input", group="tuner")
    target_modules: list[str] = arg(help="modules to adapt: all-linear, names such as q_proj "
                                    "v_proj, or one regex over full module names such as "
                                    r"'.*\.(q|v)_proj'", factory=lambda: ["all-linear"],
                                    group="tuner")
    use_dora: bool = arg(False, "DoRA: a trained magnitude per output row on top of LoRA "
                         "(peft's use_dora)", group="tuner")
    use_rslora: bool = arg(False, "rsLoRA: scale = alpha / sqrt(rank) (peft's use_rslora)",
                           group="tuner")
    lora_plus_lr_ratio: Optional[float] = arg(None, "LoRA+: lora_B (and DoRA magnitudes, LoRA "
                                              "biases) learn at this many times "
                                              "--learning_rate (peft's LoRA+ optimizer; 16 in "
                                              "its paper)", group="tuner")
    init_lora_weights: str = arg("true", "adapter init: true (B = 0), gaussian, pissa, "
                                 "pissa_niter_N (fast SVD, N iterations), olora; pissa/olora "
                                 "move part of the base into the adapter and are saved "
                                 "converted for the original base", group="tuner")
    neftune_noise_alpha: Optional[float] = arg(None, "NEFTune: uniform noise on the input "
                                               "embeddings in training, scaled alpha / "
                                               "sqrt(length x hidden) (5 in its paper); none "
                                               "at inference", group="tuner")
    modules_to_save: list[str] = arg(help="modules trained and saved whole beside the adapter, "
                                     "e.g. embed_tokens lm_head after adding tokens",
                                     factory=list, group="tuner")
    lora_bias: bool = arg(False, "a trained bias on each lora_B (peft's lora_bias)",
                          group="tuner")

    @property
    def mutated_init(self) -> bool:
        """PiSSA/OLoRA: part of each base weight starts in the adapter, so the model with its
        adapters switched off is a residual, not the base."""
        return self.train_type == "lora" and self.init_lora_weights.startswith(MUTATED_INIT)

    def lora_variant_problems(self) -> list[str]:
        """The variants' values, and the combinations peft cannot run, one sentence each."""
        init, problems = self.init_lora_weights, init_problems(self.init_lora_weights)
        if init == "loftq":
            problems.append("--init_lora_weights loftq replaces the base weights by their "
                            "4-bit approximation, which must then be saved and loaded as the "
                            "quantized base; swiftlite's --quant_bits quantizes the original "
                            "weights at load: use --quant_bits 4 with true or gaussian")
        if self.lora_plus_lr_ratio is not None and self.lora_plus_lr_ratio < 1:
            problems.append(f"--lora_plus_lr_ratio must be at least 1 (lora_B's rate over "
                            f"lora_A's), got {self.lora_plus_lr_ratio}")
        if self.neftune_noise_alpha is not None and self.neftune_noise_alpha <= 0:
            problems.append(f"--neftune_noise_alpha must be positive, got "
                            f"{self.neftune_noise_alpha}")
        lora_only = [f"--{n}" for n in ("use_dora", "use_rslora", "lora_bias")
                     if getattr(self, n)]
        lora_only += ["--lora_plus_lr_ratio"] * (self.lora_plus_lr_ratio is not None)
        lora_only += ["--modules_to_save"] * bool(self.modules_to_save)
        lora_only += ["--init_lora_weights"] * (init != "true")
        if self.train_type != "lora" and lora_only:
            problems.append(f"{', '.join(lora_only)} with --train_type {self.train_type}: "
                            "LoRA variants; full fine-tuning trains every weight")
        if self.use_dora and self.lora_bias:
            problems.append("--use_dora with --lora_bias: peft trains one or the other (a bias "
                            "on lora_B is not defined for DoRA)")
        if self.lora_bias and init != "true":
            problems.append(f"--lora_bias with --init_lora_weights {init}: peft starts a LoRA "
                            "bias only from the default init (true: B = 0)")
        mutated = init.startswith(MUTATED_INIT)
        kept = [f"--{n}" for n in ("use_dora", "lora_bias", "modules_to_save")
                if getattr(self, n)]
        if mutated and kept:
            problems.append(f"--init_lora_weights {init} with {', '.join(kept)}: peft converts "
                            "a PiSSA/OLoRA adapter for the original base "
                            "(path_initial_model_for_weight_conversion) from lora_A and lora_B "
                            "alone, and would drop what these add")
        if mutated and "embed_tokens" in " ".join(
                [self.target_modules] if isinstance(self.target_modules, str)
                else self.target_modules):
            problems.append(f"--init_lora_weights {init} with LoRA on the embeddings "
                            "(embed_tokens): peft's conversion for the original base keeps "
                            "lora_A and lora_B alone, and would drop the embeddings' adapter; "
                            "leave embed_tokens out of --target_modules, or use true/gaussian")
        return problems + self._placement_problems(mutated)

    def placement_problems(self, config: dict) -> list[str]:
        """The ZeRO-3 and offload refusals for a loaded DeepSpeed config (a JSON file, inline
        JSON, or the preset --deepspeed auto chose), which the preset names alone miss."""
        return self._placement_problems(self.mutated_init, config)

    def _placement_problems(self, mutated: bool, config: dict | None = None) -> list[str]:
        """Under QLoRA and DeepSpeed ZeRO-3 (the fields of the model and train groups); the
        DeepSpeed config when it is loaded, else what its preset name or dict says."""
        problems, init = [], self.init_lora_weights
        if getattr(self, "quant_bits", None) is not None and mutated:
            problems.append(f"--init_lora_weights {init} with --quant_bits: peft decomposes "
                            "full-precision weights (PiSSA refuses a quantized base), and a "
                            "re-quantized residual would not give the original base back when "
                            "the adapter is converted; drop --quant_bits, or use true/gaussian")
        ds = getattr(self, "deepspeed", None)
        if config is None and isinstance(ds, dict):
            config = ds
        if config is None:  # a preset's name says it
            zero3, offload = "zero3" in str(ds or ""), str(ds or "").endswith("_offload")
        else:
            zero = config.get("zero_optimization") or {}
            zero3 = zero.get("stage") == 3
            offload = ((zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
                       or "optimizer" in config)
        if zero3 and self.use_dora:
            problems.append(f"--use_dora with --deepspeed {'zero3' if isinstance(ds, dict) else ds}"
                            ": peft's DoRA reads each whole base weight in forward, and ZeRO-3 "
                            "holds it partitioned outside the layer's own call; use zero2")
        if zero3 and mutated:
            problems.append(f"--init_lora_weights {init} with ZeRO-3: the decomposition needs "
                            "each whole base weight at load, which ZeRO-3 partitions; use zero2")
        if self.lora_plus_lr_ratio is not None and offload:
            problems.append(f"--lora_plus_lr_ratio with --deepspeed {ds}: an offloaded (or "
                            "configured) optimizer is DeepSpeed's own optimizer, with no LoRA+ "
                            "groups; use a config without offload_optimizer or optimizer "
                            "(e.g. zero2)")
        return problems
