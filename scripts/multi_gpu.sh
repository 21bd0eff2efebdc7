#!/usr/bin/env bash
# Several GPUs on one machine, the ms-swift way: swiftlite re-runs itself under torchrun when
# NPROC_PER_NODE > 1, picks one run folder for all ranks and saves the command in args.json.
#   NPROC_PER_NODE=4 CUDA_VISIBLE_DEVICES=0,1,2,3 bash scripts/multi_gpu.sh
set -euo pipefail
source "$(dirname "$0")/_common.sh"
run env NPROC_PER_NODE="${NPROC_PER_NODE:-2}" ${CUDA_VISIBLE_DEVICES:+CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES} \
  swiftlite sft --model "$MODEL" --dataset "$DATASET" --output_dir "$OUTPUT_DIR" \
  --deepspeed "${DEEPSPEED:-zero2}" "$@"
