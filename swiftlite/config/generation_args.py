"""The generation group (infer, deploy, eval): sampling settings; the engine reads its defaults here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from swiftlite.config.fields import arg


@dataclass
class GenerationArguments:
    max_new_tokens: int = arg(512, "longest answer in tokens", group="generation")
    temperature: float = arg(0.0, "sampling temperature; 0: greedy (deterministic)",
                             group="generation")
    top_p: float = arg(1.0, "nucleus sampling: keep the smallest set of tokens whose "
                       "probability reaches top_p", group="generation")
    top_k: int = arg(50, "sample only among the k likeliest tokens (0: all)", group="generation")
    repetition_penalty: float = arg(1.0, "above 1 discourages repeating tokens",
                                    group="generation")
    do_sample: Optional[bool] = arg(None, "sample instead of greedy decoding; default: sample "
                                    "when --temperature > 0", group="generation")
    seed: Optional[int] = arg(None, "random seed for sampling", group="generation")
