#!/usr/bin/env bash
# Two nodes by environment variables; run this once on each node:
#   node 0:  NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash scripts/two_nodes.sh
#   node 1:  NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash scripts/two_nodes.sh
# MASTER_ADDR is node 0's address; --output_dir should be on a shared file system.
set -euo pipefail
source "$(dirname "$0")/_common.sh"
: "${NODE_RANK:?set NODE_RANK to 0 on the first node and 1 on the second}"
: "${MASTER_ADDR:?set MASTER_ADDR to the address of the node with NODE_RANK=0}"
run env NNODES="${NNODES:-2}" NODE_RANK="$NODE_RANK" MASTER_ADDR="$MASTER_ADDR" \
  MASTER_PORT="${MASTER_PORT:-29500}" NPROC_PER_NODE="${NPROC_PER_NODE:-8}" \
  swiftlite sft --model "$MODEL" --dataset "$DATASET" --output_dir "$OUTPUT_DIR" \
  --deepspeed "${DEEPSPEED:-zero2}" "$@"
