"""Facts that several layers must agree on, each written once."""

# The label of a position that is not trained. Hugging Face's convention: the models' own loss
# and torch's cross_entropy skip it.
IGNORE_INDEX = -100

# --gradient_accumulation_steps unset: accumulate up to this many samples per optimizer step.
DEFAULT_TOTAL_BATCH = 16

# Rows of logits the chunked loss computes at once (training.speedups.chunked_loss), which
# `swiftlite estimate` counts. Why this size: docs/performance.md.
LOSS_CHUNK_ROWS = 256

# What each DeepSpeed choice partitions or offloads, fastest first; "none" is the plain
# Trainer. The presets are the JSON files of training/deepspeed_configs.
STAGES = {
    "none": "no DeepSpeed (DDP on several GPUs)",
    "zero0": "plain data parallel (DDP-like), nothing partitioned",
    "zero1": "optimizer states partitioned across processes",
    "zero2": "optimizer states and gradients partitioned",
    "zero2_offload": "ZeRO-2 with optimizer states offloaded to CPU memory",
    "zero3": "optimizer states, gradients and parameters partitioned",
    "zero3_offload": "ZeRO-3 with optimizer states and parameters offloaded to CPU memory",
}
