"""The model group: which model, its template and dtype, QLoRA loading; and where it is placed."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from swiftlite.config.fields import arg


@dataclass
class ModelArguments:
    model: Optional[str] = arg(None, "local model folder, hub id (Qwen/Qwen2-1.5B-Instruct) or "
                               "alias (Qwen2-1.5B-Instruct, SmolLM2-135M-Instruct, tiny-qwen2)",
                               group="model")
    template: Optional[str] = arg(None, "chat template: a name from swiftlite/templates/ or a JSON file "
                                  "(an override); default (or 'model'): the model's own chat "
                                  "template, else 'default'", group="model")
    system: Optional[str] = arg(None, "default system prompt (replaces the template's)",
                                group="model")
    enable_thinking: Optional[bool] = arg(None, "Qwen3's thinking mode, passed to its chat "
                                          "template: false puts an empty think block into the "
                                          "prompt, so replies are trained and generated without "
                                          "reasoning; default: the template's (thinking), and "
                                          "for a checkpoint the setting it was trained with",
                                          group="model")
    torch_dtype: str = arg("auto", "compute and weights dtype (full fine-tuning keeps fp32 master "
                           "weights under 16 bits); auto: bf16 on Ampere+ GPUs and Ascend, fp16 "
                           "on T4/V100; on CPU fp32, but LoRA training on AMX/AVX-512-BF16 CPUs gets a "
                           "bf16 base with fp32 activations (faster: docs/performance.md)",
                           choices=("auto", "bfloat16", "float16", "float32"), group="model")
    trust_remote_code: bool = arg(False, "run code shipped with the model (off: safer)",
                                  group="model")
    attn_impl: Optional[str] = arg(None, "attention implementation (sdpa, eager, "
                                   "flash_attention_2); default: the fastest available",
                                   group="model")
    quant_bits: Optional[int] = arg(None, "QLoRA: load the frozen base model in 4 or 8 bits "
                                    "(bitsandbytes); LoRA only (docs/qlora.md)", group="model")
    quant_method: Optional[str] = arg(None, "the quantization library for --quant_bits: bnb "
                                      "(bitsandbytes, the only one and the default)",
                                      group="model")
    bnb_4bit_quant_type: str = arg("nf4", "4-bit number format: nf4 (QLoRA's normal float) or "
                                   "fp4", choices=("nf4", "fp4"), group="model")
    bnb_4bit_use_double_quant: bool = arg(True, "also quantize the 4-bit blocks' scales (about "
                                          "0.4 bits per weight less)", group="model")

    def quant_problems(self) -> list[str]:
        """--quant_bits and its companions, checked before anything loads."""
        if self.quant_bits is None:
            return [f"--quant_method {self.quant_method} needs --quant_bits 4 or 8"] \
                if self.quant_method else []
        problems = []
        if self.quant_bits not in (4, 8):
            problems.append(f"--quant_bits {self.quant_bits}: bitsandbytes loads 4 or 8 bits")
        if (self.quant_method or "bnb") != "bnb":
            problems.append(f"--quant_method {self.quant_method}: only bnb (bitsandbytes)")
        import importlib.util
        if importlib.util.find_spec("bitsandbytes") is None:
            problems.append("--quant_bits needs bitsandbytes: pip install bitsandbytes")
        return problems


@dataclass
class PlacementArguments:
    device_map: str = arg("none", "auto: spread a model too large for one GPU over the visible "
                          "GPUs (then CPU memory), by accelerate; none: the whole model on one "
                          "device", choices=("none", "auto"), group="model")


def checkpoint_or_model_problems(args) -> list[str]:
    """infer's and eval's source: --ckpt_dir (a folder) or --model."""
    problems = []
    if not args.ckpt_dir and not args.model:
        problems.append("give --ckpt_dir (a checkpoint or merged folder) or --model (a model "
                        "folder, hub id or alias)")
    if args.ckpt_dir and not os.path.isdir(args.ckpt_dir):
        problems.append(f"--ckpt_dir {args.ckpt_dir}: no such folder")
    return problems
