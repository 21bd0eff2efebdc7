"""The tuner group: LoRA (and its variants, all peft's or transformers') or full fine-tuning."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from swiftlite.config.fields import arg

INIT_LORA_WEIGHTS = ("true", "gaussian", "pissa", "pissa_niter_N", "olora", "loftq")
MUTATED_INIT = ("pissa", "olora")  # inits that move part of the base weights into the adapter


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
        init, problems = self.init_lora_weights, []
        if not re.fullmatch(r"true|gaussian|pissa|pissa_niter_[1-9]\d*|olora|loftq", init):
            problems.append(f"--init_lora_weights {init}: choose one of "
                            f"{', '.join(INIT_LORA_WEIGHTS)} (N a positive number)")
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
        return problems + self._placement_problems(mutated)

    def _placement_problems(self, mutated: bool) -> list[str]:
        """Under QLoRA and DeepSpeed ZeRO-3 (the fields of the model and train groups)."""
        problems, init = [], self.init_lora_weights
        if getattr(self, "quant_bits", None) is not None and mutated:
            problems.append(f"--init_lora_weights {init} with --quant_bits: peft decomposes "
                            "full-precision weights (PiSSA refuses a quantized base), and a "
                            "re-quantized residual would not give the original base back when "
                            "the adapter is converted; drop --quant_bits, or use true/gaussian")
        ds = getattr(self, "deepspeed", None)
        zero3 = "zero3" in str(ds or "") or (isinstance(ds, dict) and ds.get(
            "zero_optimization", {}).get("stage") == 3)
        if zero3 and self.use_dora:
            problems.append(f"--use_dora with --deepspeed {'zero3' if isinstance(ds, dict) else ds}"
                            ": peft's DoRA reads each whole base weight in forward, and ZeRO-3 "
                            "holds it partitioned outside the layer's own call; use zero2")
        if zero3 and mutated:
            problems.append(f"--init_lora_weights {init} with ZeRO-3: the decomposition needs "
                            "each whole base weight at load, which ZeRO-3 partitions; use zero2")
        if self.lora_plus_lr_ratio is not None and str(ds or "").endswith("_offload"):
            problems.append(f"--lora_plus_lr_ratio with --deepspeed {ds}: the offload presets "
                            "bring DeepSpeed's own optimizer, which has no LoRA+ groups; use "
                            f"{str(ds).removesuffix('_offload')}")
        return problems
