"""Pipelines: one module per command (sft, infer, merge-lora, estimate)."""
