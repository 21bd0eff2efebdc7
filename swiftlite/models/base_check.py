"""Is a base model the one an adapter was trained on? A LoRA adapter only means something on
top of the weights it was trained with; another base whose tensors happen to have the same
shapes (tiny-qwen2 and tiny-qwen2.5, a Qwen2 and a Qwen2.5 of one size) takes it without an
error and answers differently. The architecture part of config.json is the fingerprint: sft
records it in args.json ("base_config"); for a checkpoint older than that, the config of the
base folder it names is read, when that folder is still there."""
from __future__ import annotations

import json
import os

FIELDS = ("architectures", "model_type", "hidden_size", "intermediate_size",
          "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
          "vocab_size", "rope_theta")


def fingerprint(model_dir: str) -> dict | None:
    """The architecture fields of a model folder's config.json (None: no readable config)."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return {k: config[k] for k in FIELDS if k in config} if isinstance(config, dict) else None


def recorded_base(ckpt_dir: str, run_args: dict) -> tuple[str | None, dict | None]:
    """(the name of the base a checkpoint was trained on, its fingerprint or None)."""
    adapter = {}
    try:
        with open(os.path.join(ckpt_dir, "adapter_config.json"), encoding="utf-8") as f:
            adapter = json.load(f)
    except (OSError, ValueError):
        pass
    named = adapter.get("base_model_name_or_path") if isinstance(adapter, dict) else None
    name = run_args.get("model") or named
    if isinstance(run_args.get("base_config"), dict):
        return name, run_args["base_config"]
    for folder in (run_args.get("model_dir"), named):
        if isinstance(folder, str) and os.path.isdir(folder):
            return name, fingerprint(folder)
    return name, None


def differences(trained: dict, given: dict | None) -> list[str]:
    """One phrase per architecture field in which `given` differs from `trained`."""
    given = given or {}
    return [f"{k} {trained.get(k)} (trained) vs {given.get(k)}" for k in FIELDS
            if (k in trained or k in given) and trained.get(k) != given.get(k)]
