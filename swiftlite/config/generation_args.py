"""The generation group (infer, deploy, eval): sampling settings; the engine reads its defaults here."""
from __future__ import annotations

import dataclasses
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

    def generation_problems(self) -> list[str]:
        problems = []
        if self.max_new_tokens <= 0:
            problems.append(f"--max_new_tokens must be a positive number, got {self.max_new_tokens}")
        if self.temperature < 0:
            problems.append(f"--temperature must be 0 or more, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"--top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            problems.append(f"--top_k must be 0 or more, got {self.top_k}")
        if self.repetition_penalty <= 0:
            problems.append(f"--repetition_penalty must be positive, got "
                            f"{self.repetition_penalty}")
        return problems

    def generation_kwargs(self) -> dict:
        """The engine's generation keywords (these fields)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(GenerationArguments)}
