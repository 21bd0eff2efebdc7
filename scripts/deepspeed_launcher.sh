#!/usr/bin/env bash
# The `deepspeed` launcher. DS_ARGS chooses the processes:
#   DS_ARGS="--num_gpus 2"                 two GPUs of this machine (default)
#   DS_ARGS="--include localhost:1"        only GPU 1 of this machine
#   DS_ARGS="--hostfile scripts/hostfile"  every host in the file ("host slots=N" lines; needs
#                                          passwordless ssh between the hosts, see hostfile)
#   bash scripts/deepspeed_launcher.sh [--extra_flag value ...]
set -euo pipefail
source "$(dirname "$0")/_common.sh"
# shellcheck disable=SC2086  # DS_ARGS is a list of launcher flags
run deepspeed ${DS_ARGS:---num_gpus 2} --master_port "${MASTER_PORT:-29500}" \
  --module swiftlite.cli sft --model "$MODEL" --dataset "$DATASET" --output_dir "$OUTPUT_DIR" \
  --deepspeed "${DEEPSPEED:-zero2}" "$@"
