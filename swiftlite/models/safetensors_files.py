"""A model folder's safetensors files read from their headers: which file holds each tensor,
and each tensor's dtype and shape, without reading any tensor data. Missing or corrupt files
are refused with what to do. Used by the loader (cast on load) and by merge-lora."""
from __future__ import annotations

import json
import os

from swiftlite.errors import UsageError


def base_index(model_dir: str) -> dict[str, str]:
    """tensor name -> safetensors file of the base model; refuses missing or corrupt files."""
    from safetensors import safe_open
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise UsageError(f"{index}: not a valid safetensors index ({e}).") from None
        files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(model_dir, "model.safetensors")):
        files, weight_map = ["model.safetensors"], None
    else:
        raise UsageError(f"{model_dir}: no model.safetensors (or sharded index) found. merge-lora "
                         "reads safetensors only; convert the base model with transformers' "
                         "save_pretrained(safe_serialization=True) first.")
    out = {}
    for name in files:
        path = os.path.join(model_dir, name)
        if not os.path.exists(path):
            raise UsageError(f"{path}: missing (listed in the model's safetensors index). The "
                             "base model download is incomplete; download it again.")
        try:
            with safe_open(path, "pt") as f:
                keys = list(f.keys())
        except Exception as e:  # safetensors raises its own SafetensorError on a bad header
            raise UsageError(f"{path}: not a readable safetensors file ({e}). The file is "
                             "corrupt or truncated; download the base model again.") from None
        for k in keys:
            out[k] = path
    if weight_map is not None:
        missing = [k for k, v in weight_map.items() if out.get(k) != os.path.join(model_dir, v)]
        if missing:
            raise UsageError(f"{model_dir}: the safetensors index lists {len(missing)} tensor(s) "
                             f"not found in their files (first: {missing[0]}); the files are "
                             "corrupt or from another model.")
    return out


def tensor_meta(index: dict[str, str]) -> dict[str, tuple[str, list[int]]]:
    """name -> (safetensors dtype, shape), read from headers only."""
    from safetensors import safe_open
    meta = {}
    for path in sorted(set(index.values())):
        with safe_open(path, "pt") as f:
            for k in f.keys():
                s = f.get_slice(k)
                meta[k] = (s.get_dtype(), list(s.get_shape()))
    return meta


def element_size(st_dtype: str) -> int:
    return {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2}.get(st_dtype, 1)
