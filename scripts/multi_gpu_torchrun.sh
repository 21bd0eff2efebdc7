#!/usr/bin/env bash
# Several GPUs on one machine with torchrun started by hand (rank 0 picks the run folder and
# sends it to the other ranks through torchrun's rendezvous store).
#   NPROC_PER_NODE=8 bash scripts/multi_gpu_torchrun.sh --per_device_train_batch_size 2
set -euo pipefail
source "$(dirname "$0")/_common.sh"
run torchrun --nproc_per_node "${NPROC_PER_NODE:-2}" --master_port "${MASTER_PORT:-29500}" \
  -m swiftlite.cli sft --model "$MODEL" --dataset "$DATASET" --output_dir "$OUTPUT_DIR" \
  --deepspeed "${DEEPSPEED:-zero2}" "$@"
