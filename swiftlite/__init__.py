"""swiftlite: LoRA supervised fine-tuning for Qwen2-class causal language models.

Python API (the same arguments as the CLI):
    swiftlite.sft(model="SmolLM2-135M-Instruct", dataset=["self-cognition#500"], ...)
    swiftlite.rlhf(model="SmolLM2-135M-Instruct", dataset=["pairs.jsonl"], rlhf_type="dpo")
    swiftlite.eval(ckpt_dir=..., eval_dataset=["qa.jsonl"], compare="SmolLM2-135M-Instruct")
    swiftlite.merge_lora(ckpt_dir="output/.../checkpoint-50")
    swiftlite.infer(ckpt_dir=..., messages=[...])
    swiftlite.deploy(ckpt_dir=..., adapters=["name=path"], port=8000)   # serves until stopped
    swiftlite.get_template(None, tokenizer).encode(messages, tools)  # the model's own template
Heavy libraries are imported only when a function is called.
"""
__version__ = "0.1.0"

_LAZY = {
    "sft": ("swiftlite.pipelines.sft", "sft"),
    "SftArguments": ("swiftlite.config.arguments", "SftArguments"),
    "rlhf": ("swiftlite.pipelines.rlhf", "rlhf"),
    "RlhfArguments": ("swiftlite.config.rlhf_args", "RlhfArguments"),
    "eval": ("swiftlite.pipelines.eval", "eval"),
    "EvalArguments": ("swiftlite.config.eval_args", "EvalArguments"),
    "get_template": ("swiftlite.data.template", "get_template"),
    "merge_lora": ("swiftlite.pipelines.merge", "merge_lora"),
    "infer": ("swiftlite.pipelines.infer", "infer"),
    "deploy": ("swiftlite.pipelines.deploy", "deploy"),
    "SwiftliteError": ("swiftlite.errors", "SwiftliteError"),
    "UsageError": ("swiftlite.errors", "UsageError"),
}
__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'swiftlite' has no attribute {name!r}")
