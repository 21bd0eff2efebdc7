"""A model's architecture from its config.json alone: the config for an alias, folder, file or
hub id, and the model built on the meta device (every module and shape, no weights, no
memory). Used by `swiftlite estimate` and by sft's checks before the weights load."""
from __future__ import annotations

import json
import os

from swiftlite.errors import UsageError


def read_config(model: str) -> tuple[str, dict]:
    """(name, config dict) for --model: a folder with config.json, a config.json file, a
    registry alias (configs shipped in swiftlite/models/configs) or a hub id (config.json only
    is downloaded)."""
    if os.path.isdir(model):
        path = os.path.join(model, "config.json")
        if not os.path.isfile(path):
            raise UsageError(f"--model {model}: the folder has no config.json.")
        return os.path.basename(os.path.normpath(model)), _load(path)
    if os.path.isfile(model):
        return os.path.basename(os.path.dirname(os.path.abspath(model))) or model, _load(model)
    from swiftlite.models.registry import lookup
    info = lookup(model)
    alias = info.alias if info else model
    from importlib import resources
    shipped = resources.files("swiftlite.models").joinpath("configs", f"{alias}.json")
    if shipped.is_file():
        return alias, json.loads(shipped.read_text(encoding="utf-8"))
    if alias in ("tiny-qwen2", "tiny-qwen2.5", "tiny-qwen3"):
        from swiftlite.models.builtin import TINY_QWEN2_CONFIG
        extra = {"model_type": "qwen3", "head_dim": 16} if alias == "tiny-qwen3" else {
            "model_type": "qwen2"}
        return alias, {**TINY_QWEN2_CONFIG, **extra}
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        try:
            from huggingface_hub import hf_hub_download
            return model.split("/")[-1], _load(hf_hub_download(model, "config.json"))
        except Exception as e:  # offline, unknown or gated repo
            raise UsageError(f"--model {model}: could not fetch its config.json from the hub "
                             f"({type(e).__name__}). Pass a local model folder or config.json "
                             "instead.") from None
    raise UsageError(f"--model {model}: not a folder, a config.json, a known alias or a hub id "
                     "(org/name).")


def _load(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except ValueError as e:
        raise UsageError(f"{path}: not valid JSON ({e}).") from None


def meta_model(name: str, config: dict):
    """(transformers config, model) of this config.json's architecture on the meta device:
    every module and parameter shape, no memory, no weights read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = {k: v for k, v in config.items() if not k.startswith("_")}
    model_type = cfg.pop("model_type", None)
    if not model_type:
        raise UsageError(f"{name}: config.json has no model_type.")
    try:
        hf_config = AutoConfig.for_model(model_type, **cfg)
        with torch.device("meta"):
            return hf_config, AutoModelForCausalLM.from_config(hf_config)
    except (ValueError, KeyError) as e:
        raise UsageError(f"{name}: cannot build model_type {model_type!r} from its config "
                         f"({e}).") from None
