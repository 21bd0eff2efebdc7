"""swiftlite: LoRA supervised fine-tuning for Qwen2-class causal language models.

Python API (the same arguments as the CLI):
    swiftlite.sft(model="SmolLM2-135M-Instruct", dataset=["self-cognition#500"], ...)
    swiftlite.rlhf(model="SmolLM2-135M-Instruct", dataset=["pairs.jsonl"], rlhf_type="dpo")
    swiftlite.eval(ckpt_dir=..., eval_dataset=["qa.jsonl"], compare="SmolLM2-135M-Instruct")
    swiftlite.merge_lora(ckpt_dir="output/.../checkpoint-50")
    swiftlite.export(ckpt_dir="output/.../checkpoint-50", quant="q4_k_m")  # GGUF + Modelfile
    swiftlite.infer(ckpt_dir=..., messages=[...])
    swiftlite.deploy(ckpt_dir=..., adapters=["name=path"], port=8000)   # serves until stopped
    swiftlite.get_template(None, tokenizer).encode(messages, tools)  # the model's own template
Heavy libraries are imported only when a function is called.
"""
__version__ = "0.1.0"

# module -> the names it gives the package, imported on first use
_MODULES = {
    "swiftlite.pipelines.sft": ("sft",),
    "swiftlite.pipelines.rlhf": ("rlhf",),
    "swiftlite.pipelines.eval": ("eval",),
    "swiftlite.pipelines.merge": ("merge_lora",),
    "swiftlite.pipelines.export": ("export",),
    "swiftlite.pipelines.infer": ("infer",),
    "swiftlite.pipelines.deploy": ("deploy",),
    "swiftlite.config.arguments": ("SftArguments", "RlhfArguments", "EvalArguments"),
    "swiftlite.data.template": ("get_template",),
    "swiftlite.errors": ("SwiftliteError", "UsageError"),
}
_LAZY = {name: module for module, names in _MODULES.items() for name in names}
__all__ = list(_LAZY)


def _make_export_callable():
    """`swiftlite.export` is also the export layer's package (swiftlite/export/): once any of
    its modules is imported, Python sets the package as this attribute. So the package itself
    is made callable, as the Python API swiftlite.export(...). Its __init__ is a docstring:
    importing it here loads nothing else."""
    import importlib
    import types

    class CallableExport(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return getattr(importlib.import_module(_LAZY["export"]), "export")(*args, **kwargs)

    importlib.import_module("swiftlite.export").__class__ = CallableExport


_make_export_callable()


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'swiftlite' has no attribute {name!r}")
