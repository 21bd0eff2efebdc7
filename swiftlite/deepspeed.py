"""DeepSpeed configuration for the Trainer (presets, auto values, CPU-only enablement)."""
from __future__ import annotations


def training_kwargs(args, hw) -> dict:
    """Extra TrainingArguments for args.deepspeed (a JSON file path or dict for now)."""
    return {"deepspeed": args.deepspeed} if args.deepspeed else {}
