"""Arguments of `swiftlite merge-lora`."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from swiftlite.config.fields import arg, check_choices, raise_if, same_as
from swiftlite.config.model_args import ModelArguments
from swiftlite.config.sizes import parse_size


@dataclass
class MergeArguments:
    """Arguments of `swiftlite merge-lora`."""
    ckpt_dir: Optional[str] = arg(None, "the LoRA checkpoint folder to merge", group="model")
    output_dir: Optional[str] = arg(None, "where to write the merged model (default: "
                                    "<ckpt_dir>-merged)", group="model")
    model: Optional[str] = arg(None, "base model folder, hub id or alias (default: the one the "
                               "run trained, from args.json)", group="model")
    template: Optional[str] = arg(None, "chat template to write into the merged tokenizer "
                                  "(default: the training one)", group="model")
    system: Optional[str] = arg(None, "default system prompt to write (default: the training "
                                "one)", group="model")
    enable_thinking: Optional[bool] = same_as(ModelArguments, "enable_thinking", help="Qwen3's "
                                              "thinking mode to write into the merged template "
                                              "as its default (default: the training one)")
    torch_dtype: str = arg("auto", "dtype of the saved weights; auto: the training dtype (the "
                           "merge itself is always fp32)", choices=("auto", "bfloat16", "float16",
                                                                    "float32"), group="model")
    max_shard_size: str = arg("5GB", "largest safetensors file, e.g. 2GB or 500MB",
                              group="model")
    exist_ok: bool = arg(False, "replace an existing output folder", group="model")
    allow_base_mismatch: bool = arg(False, "merge into a --model whose architecture differs "
                                    "from the base the adapter was trained on (its config "
                                    "recorded in the checkpoint); refused otherwise",
                                    group="model")
    verify: bool = arg(True, "compare merged and adapter logits on a few samples (loads the "
                       "model twice, one after the other)", group="model")
    quant_bits: Optional[int] = arg(None, "not accepted (the merge writes full-precision "
                                    "weights); a field only to say why", group="hidden")

    def validate(self) -> "MergeArguments":
        problems = []
        if self.quant_bits is not None:
            problems.append(f"--quant_bits {self.quant_bits}: merge-lora adds the adapter to the "
                            "full-precision base (read from its safetensors files); merging into "
                            f"{self.quant_bits}-bit weights would round the small LoRA updates "
                            "away (one quantization step is far larger). Merge without it, then "
                            "load the merged model quantized where it is served (swiftlite "
                            f"infer/deploy --model MERGED --quant_bits {self.quant_bits})")
        if not self.ckpt_dir:
            problems.append("--ckpt_dir is required (a checkpoint folder written by swiftlite "
                            "sft, e.g. output/<model>/v0-.../checkpoint-50)")
        elif not os.path.isdir(self.ckpt_dir):
            problems.append(f"--ckpt_dir {self.ckpt_dir}: no such folder")
        problems += check_choices(self)
        try:
            parse_size(self.max_shard_size)
        except ValueError as e:
            problems.append(f"--max_shard_size: {e}")
        raise_if(problems)
        return self
