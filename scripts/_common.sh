# Shared by the launch recipes. Every recipe takes the same overrides from the environment
# (MODEL, DATASET, OUTPUT_DIR, DEEPSPEED) and passes any extra arguments on to `swiftlite sft`.
# DRY_RUN=1 prints the command instead of running it (the tests check what a recipe builds).
MODEL=${MODEL:-Qwen2-1.5B-Instruct}
DATASET=${DATASET:-self-cognition#500}
OUTPUT_DIR=${OUTPUT_DIR:-output}

run() {
  if [ -n "${DRY_RUN:-}" ]; then
    printf '%q ' "$@"; echo
  else
    echo "+ $*" >&2
    "$@"
  fi
}
