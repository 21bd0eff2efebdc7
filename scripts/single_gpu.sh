#!/usr/bin/env bash
# One GPU (or the CPU when there is none): LoRA SFT in one process.
#   bash scripts/single_gpu.sh [--extra_flag value ...]
#   CUDA_VISIBLE_DEVICES=1 bash scripts/single_gpu.sh      # pick the second GPU
set -euo pipefail
source "$(dirname "$0")/_common.sh"
run env CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}" \
  swiftlite sft --model "$MODEL" --dataset "$DATASET" --output_dir "$OUTPUT_DIR" "$@"
