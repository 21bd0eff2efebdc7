"""Arguments of `swiftlite estimate`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from swiftlite.config.fields import arg, check_choices, not_positive, raise_if


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
    train_type: str = arg("lora", "lora or full", choices=("lora", "full"), group="tuner")
    lora_rank: int = arg(8, "LoRA rank r", group="tuner")
    lora_dropout: float = arg(0.05, "dropout on the LoRA input", group="tuner")
    target_modules: list[str] = arg(help="modules to adapt: all-linear, or names such as q_proj "
                                    "v_proj", factory=lambda: ["all-linear"], group="tuner")
    max_length: int = arg(2048, "tokens per sample (the worst case: every sample this long)",
                          group="train")
    batch_size: int = arg(1, "per-device batch size (sft's --per_device_train_batch_size)",
                          group="train")
    chunked_loss: bool = arg(True, "as sft's --chunked_loss: LM head and loss in chunks (not "
                             "possible under ZeRO-3, which uses the model's own loss)",
                             group="train")
    selective_checkpointing: bool = arg(False, "as sft's --selective_checkpointing (LoRA): the "
                                        "output of every frozen matmul kept with each "
                                        "checkpointed layer input", group="train")
    quant_bits: Optional[int] = arg(None, "as sft's --quant_bits (QLoRA): the frozen linear "
                                    "layers in 4 or 8 bits, with their quantization scales",
                                    group="tuner")
    bnb_4bit_use_double_quant: bool = arg(True, "as sft's: 4-bit scales quantized too",
                                          group="tuner")
    rlhf_type: Optional[str] = arg(None, "as rlhf's --rlhf_type: dpo, orpo, simpo and cpo "
                                   "train two sequences (chosen and rejected) per pair, so a "
                                   "batch holds twice the tokens; kto one (the reference and its "
                                   "KL passes run without gradients: they keep no activations)",
                                   group="train")
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
        problems += check_choices(self)
        problems += not_positive(self, ("gpus", "nodes", "lora_rank", "max_length", "batch_size"))
        if not 0 <= self.lora_dropout < 1:
            problems.append(f"--lora_dropout must be in [0, 1), got {self.lora_dropout}")
        raise_if(problems)
        return self
