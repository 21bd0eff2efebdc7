"""Arguments of `swiftlite eval`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from swiftlite.config.fields import arg, check_choices, not_positive, raise_if
from swiftlite.config.generation_args import GenerationArguments
from swiftlite.config.model_args import (ModelArguments, PlacementArguments,
                                          checkpoint_or_model_problems)
from swiftlite.config.vllm_args import BackendArguments


@dataclass
class EvalArguments(ModelArguments, PlacementArguments, GenerationArguments, BackendArguments):
    """Arguments of `swiftlite eval`: a model or checkpoint scored on evaluation sets."""
    ckpt_dir: Optional[str] = arg(None, "a LoRA checkpoint (base + adapter) or a merged model "
                                  "folder to evaluate", group="model")
    eval_dataset: list[str] = arg(help="evaluation sets: chat rows in any --dataset format (the "
                                  "last assistant message is the reference; answers are "
                                  "generated and scored) or multiple-choice files with "
                                  "question, A, B, ... and answer columns; FILE#N samples N rows",
                                  factory=list, group="eval")
    output_dir: Optional[str] = arg(None, "where metrics.json and predictions.jsonl go (default: "
                                    "<ckpt_dir or output>/eval/<timestamp>)", group="eval")
    compare: Optional[str] = arg(None, "also evaluate this model or checkpoint on the same rows "
                                 "and print both side by side (e.g. the base model)",
                                 group="eval")
    n_shot: int = arg(0, "multiple choice: ask and answer the file's first N questions before "
                      "each of the others (they are not scored)", group="eval")
    eval_loss: bool = arg(True, "chat sets: also the loss and perplexity of the references "
                          "(teacher-forced, with the training encoding)", group="eval")
    max_batch_size: int = arg(8, "rows generated or scored together", group="eval")
    skip_bad_rows: bool = arg(False, "leave malformed chat rows out (counted) instead of "
                              "stopping", group="eval")

    def validate(self) -> "EvalArguments":
        problems = checkpoint_or_model_problems(self)
        if not self.eval_dataset:
            problems.append("--eval_dataset is required (one or more files)")
        if self.n_shot < 0:
            problems.append(f"--n_shot must be 0 or more, got {self.n_shot}")
        problems += self.quant_problems() + check_choices(self) + self.generation_problems()
        problems += self.backend_problems()
        problems += not_positive(self, ("max_batch_size",))
        raise_if(problems)
        return self
