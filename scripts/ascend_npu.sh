#!/usr/bin/env bash
# Ascend NPUs (torch_npu installed; HCCL is chosen as the backend by swiftlite.runtime.hardware).
#   ASCEND_RT_VISIBLE_DEVICES=0,1,2,3 NPROC_PER_NODE=4 bash scripts/ascend_npu.sh
set -euo pipefail
source "$(dirname "$0")/_common.sh"
run env ASCEND_RT_VISIBLE_DEVICES="${ASCEND_RT_VISIBLE_DEVICES:-0,1}" \
  NPROC_PER_NODE="${NPROC_PER_NODE:-2}" \
  swiftlite sft --model "$MODEL" --dataset "$DATASET" --output_dir "$OUTPUT_DIR" \
  --deepspeed "${DEEPSPEED:-zero2}" "$@"
