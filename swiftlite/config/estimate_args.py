"""Arguments of `swiftlite estimate`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from swiftlite.config.fields import arg, check_choices, not_positive, raise_if, same_as
from swiftlite.config.model_args import ModelArguments
from swiftlite.config.train_args import TrainArguments
from swiftlite.config.tuner_args import LoraArguments, init_problems


@dataclass
class EstimateArguments:
    """Arguments of `swiftlite estimate`: training memory from the model's config.json alone."""
    model: Optional[str] = arg(None, "model folder, config.json, alias (Qwen2-1.5B-Instruct) or "
                               "hub id; only its config is read", group="model")
    torch_dtype: str = arg("bfloat16", "training dtype (float16: T4/V100)",
                           choices=("bfloat16", "float16", "float32"), group="model")
    gpus: int = arg(1, "GPUs (training processes) per node", group="hardware")
    nodes: int = arg(1, "nodes", group="hardware")
    gpu_memory: str = arg("24GB", "memory of one GPU, e.g. 24GB, 80GB (GB read as GiB)",
                          group="hardware")
    cpu_memory: Optional[str] = arg(None, "CPU memory per node, e.g. 256GB; offload options "
                                    "needing more are not recommended (default: not checked)",
                                    group="hardware")
    train_type: str = same_as(LoraArguments, "train_type")
    lora_rank: int = same_as(LoraArguments, "lora_rank")
    lora_dropout: float = same_as(LoraArguments, "lora_dropout")
    target_modules: list[str] = same_as(LoraArguments, "target_modules")
    use_dora: bool = same_as(LoraArguments, "use_dora")
    init_lora_weights: str = same_as(LoraArguments, "init_lora_weights")
    modules_to_save: list[str] = same_as(LoraArguments, "modules_to_save")
    max_length: int = arg(2048, "tokens per sample (the worst case: every sample this long)",
                          group="train")
    batch_size: int = arg(1, "per-device batch size (sft's --per_device_train_batch_size)",
                          group="train")
    chunked_loss: bool = same_as(TrainArguments, "chunked_loss")
    selective_checkpointing: Optional[bool] = same_as(
        TrainArguments, "selective_checkpointing", help="LoRA with gradient checkpointing: count "
        "the outputs of frozen matmuls kept instead of recomputed in every layer (on GPUs, "
        "where swiftlite keeps none unless asked)")
    quant_bits: Optional[int] = same_as(ModelArguments, "quant_bits", group="tuner")
    bnb_4bit_use_double_quant: bool = same_as(ModelArguments, "bnb_4bit_use_double_quant",
                                              group="tuner")
    rlhf_type: Optional[str] = arg(None, "rlhf's method (default: sft): dpo, orpo, simpo and "
                                   "cpo train two sequences per pair; kto one", group="train")
    json: bool = arg(False, "print JSON instead of the table", group="train")

    def validate(self) -> "EstimateArguments":
        problems = []
        if self.quant_bits not in (None, 4, 8):
            problems.append(f"--quant_bits {self.quant_bits}: 4 or 8")
        if self.quant_bits is not None and self.train_type != "lora":
            problems.append("--quant_bits: LoRA only (a quantized base is not trained itself)")
        if not self.model:
            problems.append("--model is required (an alias such as Qwen2-1.5B-Instruct, a model "
                            "folder or a config.json)")
        if self.rlhf_type not in (None, "dpo", "orpo", "simpo", "cpo", "kto"):
            problems.append(f"--rlhf_type {self.rlhf_type}: choose one of dpo, orpo, simpo, "
                            "cpo, kto")
        problems += check_choices(self) + init_problems(self.init_lora_weights)
        problems += not_positive(self, ("gpus", "nodes", "lora_rank", "max_length", "batch_size"))
        if not 0 <= self.lora_dropout < 1:
            problems.append(f"--lora_dropout must be in [0, 1), got {self.lora_dropout}")
        raise_if(problems)
        return self
