"""The training group: output, schedule, checkpoints, DeepSpeed and the speed-ups."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from swiftlite.config.constants import DEFAULT_TOTAL_BATCH
from swiftlite.config.fields import arg


@dataclass
class TrainArguments:
    output_dir: Optional[str] = arg(None, "output root; the run goes to "
                                    "<output_dir>/v<N>-<timestamp> (default output/<model>)",
                                    group="train")
    add_version: bool = arg(True, "add the v<N>-<timestamp> run folder under --output_dir",
                            group="train")
    num_train_epochs: float = arg(3.0, "epochs (ignored when --max_steps > 0)", group="train")
    max_steps: int = arg(-1, "optimizer steps; -1: use --num_train_epochs", group="train")
    per_device_train_batch_size: int = arg(1, "samples per device per step", group="train")
    per_device_eval_batch_size: int = arg(1, "samples per device per eval step", group="train")
    gradient_accumulation_steps: Optional[int] = arg(
        None, f"micro-batches per optimizer step; default: a total batch of "
        f"{DEFAULT_TOTAL_BATCH}", group="train")
    learning_rate: float = arg(1e-4, "peak learning rate", group="train")
    lr_scheduler_type: str = arg("cosine", "learning rate schedule", group="train")
    warmup_ratio: float = arg(0.05, "share of steps for linear warmup", group="train")
    weight_decay: float = arg(0.1, "AdamW weight decay", group="train")
    max_grad_norm: float = arg(1.0, "gradient clipping", group="train")
    logging_steps: int = arg(5, "log every N steps", group="train")
    save_steps: int = arg(500, "save a checkpoint every N steps", group="train")
    eval_steps: Optional[int] = arg(None, "evaluate every N steps (default: --save_steps)",
                                    group="train")
    early_stopping_patience: Optional[int] = arg(None, "stop when the eval metric "
                                                 "(--metric_for_best_model, default eval_loss) "
                                                 "has not improved for N evaluations; the best "
                                                 "checkpoint is named at the end",
                                                 group="train")
    eval_generate: bool = arg(False, "at each evaluation, also answer the validation rows "
                              "(greedy) and log ROUGE-1/2/L, BLEU-4, exact match and stopped, "
                              "as swiftlite eval scores them", group="train")
    eval_max_new_tokens: int = arg(128, "--eval_generate: longest answer in tokens",
                                   group="train")
    save_total_limit: Optional[int] = arg(None, "keep only the last N checkpoints",
                                          group="train")
    seed: int = arg(42, "random seed", group="train")
    gradient_checkpointing: bool = arg(True, "recompute activations in backward to save "
                                       "memory", group="train")
    selective_checkpointing: Optional[bool] = arg(
        None, "LoRA with --gradient_checkpointing: keep the outputs of frozen matmuls instead of "
        "recomputing them (faster for memory per token: docs/performance.md); true: in every "
        "layer, false: none; default: on a CPU with --fused_lora over a 16-bit base, in as many "
        "layers as fit in half the frozen weights' memory (at most a tenth of the memory "
        "available), elsewhere none", group="train")
    keep_attention: bool = arg(True, "on a CPU with --gradient_checkpointing and "
                               "--padding_free: keep each layer's attention output from the "
                               "forward pass for the recompute instead of running attention "
                               "again (the same numbers, for memory per token: "
                               "docs/performance.md)", group="train")
    onednn_fp32: bool = arg(True, "on a CPU with an fp32 base: its matmuls (frozen layers in "
                            "--fused_lora, LM head in --chunked_loss) through oneDNN when it is "
                            "at least 1.2x torch's BLAS here, measured at start (on AVX-512 CPUs "
                            "whose BLAS runs AVX2 code); false: torch's BLAS", group="train")
    deepspeed: Optional[Union[str, dict]] = arg(None, "DeepSpeed: zero0/zero1/zero2/zero3/zero2_offload/"
                                   "zero3_offload, auto (the fastest that fits, per swiftlite "
                                   "estimate), a JSON file or inline JSON", group="train")
    resume_from_checkpoint: Optional[str] = arg(None, "continue from this checkpoint folder, "
                                                "or a run folder's last complete checkpoint",
                                                group="train")
    padding_free: bool = arg(True, "pack each batch into one row without padding (attention "
                             "stays inside each sample); false: pad to the longest",
                             group="train")
    chunked_loss: bool = arg(True, "LM head and loss only at trained positions, in chunks (less "
                             "time, no length x vocab logits in memory); false: the model's own "
                             "loss", group="train")
    fast_dropout: bool = arg(True, "on a CPU, LoRA dropout draws only the positions it drops "
                             "(about p x the elements) instead of a random mask over all of "
                             "them; false: nn.Dropout", group="train")
    fused_lora: bool = arg(True, "on a CPU, each LoRA layer's adapter branch as one autograd "
                           "function with its gradients in fast matmul layouts, and checkpointing "
                           "no longer recomputes the last matmul of a layer; false: peft's modules",
                           group="train")
    fp32_activations: bool = arg(True, "with --torch_dtype bfloat16 on a CPU: bf16 matmuls but "
                                 "fp32 activations, so small LoRA updates are not rounded away; "
                                 "false: all-bf16 activations", group="train")
    batch_threads: Optional[int] = arg(
        None, "sft on a CPU: train each batch's samples in N threads, each on a share of the "
        "cores (the same step, less time between operators: docs/performance.md); default: 2 "
        "on 2 or more cores where the base is 16-bit, every LoRA layer is fused and the model "
        "has no dropout of its own; 1: off", group="train")
    bf16_lora_matmuls: bool = arg(True, "with --fp32_activations and --fused_lora: the LoRA "
                                  "adapters' matmuls take bf16 inputs too, their results rounded "
                                  "to bf16 once (sums, weights and optimizer state stay fp32); "
                                  "false: fp32 adapter matmuls", group="train")
