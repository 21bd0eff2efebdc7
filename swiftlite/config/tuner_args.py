"""The tuner group: LoRA or full fine-tuning."""
from __future__ import annotations

from dataclasses import dataclass

from swiftlite.config.fields import arg


@dataclass
class LoraArguments:
    train_type: str = arg("lora", "lora: train adapters on a frozen model; full: all weights",
                          choices=("lora", "full"), group="tuner")
    lora_rank: int = arg(8, "LoRA rank r", group="tuner")
    lora_alpha: int = arg(32, "LoRA alpha (scale = alpha / rank)", group="tuner")
    lora_dropout: float = arg(0.05, "dropout on the LoRA input", group="tuner")
    target_modules: list[str] = arg(help="modules to adapt: all-linear, or names such as "
                                    "q_proj v_proj", factory=lambda: ["all-linear"],
                                    group="tuner")
