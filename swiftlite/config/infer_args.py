"""Arguments of `swiftlite infer`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from swiftlite.config.fields import arg, check_choices, not_positive, raise_if
from swiftlite.config.generation_args import GenerationArguments
from swiftlite.config.model_args import (ModelArguments, PlacementArguments,
                                          checkpoint_or_model_problems)


@dataclass
class InferArguments(ModelArguments, PlacementArguments, GenerationArguments):
    """Arguments of `swiftlite infer`. With --ckpt_dir the model, template, system prompt and
    dtype come from the run's args.json; flags override them."""
    ckpt_dir: Optional[str] = arg(None, "a LoRA checkpoint (loaded as base + adapter) or a merged "
                                  "model folder", group="model")
    query: Optional[str] = arg(None, "answer this one question, print the answer and exit",
                               group="infer")
    tools: Optional[str] = arg(None, "functions the model may call: a JSON file or JSON text "
                               "with a list of OpenAI function schemas; tool calls in the answer "
                               "are printed as JSON (batch mode: a row's own tools win)",
                               group="infer")
    val_dataset: list[str] = arg(help="batch mode: answer every conversation of these files "
                                 "(any --dataset format) and write JSONL to --result_path",
                                 factory=list, group="infer")
    skip_bad_rows: bool = arg(False, "batch mode: skip malformed rows (counted per reason) "
                              "instead of stopping", group="infer")
    result_path: Optional[str] = arg(None, "batch mode output JSONL (default: "
                                     "<ckpt_dir or output>/infer_result/<timestamp>.jsonl)",
                                     group="infer")
    max_batch_size: int = arg(8, "batch mode: conversations generated together", group="infer")
    stream: bool = arg(True, "interactive mode: print the answer token by token", group="infer")

    def validate(self) -> "InferArguments":
        problems = checkpoint_or_model_problems(self)
        if self.query is not None and not self.query.strip():
            problems.append("--query is empty")
        if self.query is not None and self.val_dataset:
            problems.append("give --query or --val_dataset, not both")
        problems += self.quant_problems()

        problems += check_choices(self)
        problems += not_positive(self, ("max_batch_size",)) + self.generation_problems()
        raise_if(problems)
        return self
