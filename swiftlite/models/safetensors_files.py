"""A model folder's safetensors files read from their headers: which file holds each tensor,
and each tensor's dtype and shape, without reading any tensor data. Missing or corrupt files
are refused with what to do. Used by the loader (cast on load) and by merge-lora."""
from __future__ import annotations

import json
import os

from swiftlite.errors import UsageError


def base_index(model_dir: str) -> dict[str, str]:
    """tensor name -> safetensors file of the base model; refuses missing or corrupt files."""
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
        for k in read_header(path, "download the base model again"):
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
    meta = {}
    for path in sorted(set(index.values())):
        meta.update(read_header(path))
    return meta


def read_header(path: str, fix: str = "") -> dict[str, tuple[str, list[int]]]:
    """One file's name -> (safetensors dtype, shape). The header is a little-endian u64 length
    and that much JSON, so this needs neither torch nor the tensor data. `fix`: what to do
    about a corrupt file, for the error."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= os.path.getsize(path) - 8:
                raise ValueError(f"a header length of {size} bytes")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        data = os.path.getsize(path) - 8 - size
        end = max((v["data_offsets"][1] for v in header.values()), default=0)
        if end != data:
            raise ValueError(f"its header describes {end} bytes of tensor data, it holds {data}")
        return {k: (v["dtype"], list(v["shape"])) for k, v in header.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        raise UsageError(f"{path}: not a readable safetensors file ({e}). The file is corrupt "
                         f"or truncated{'; ' + fix if fix else ''}.") from None


def element_size(st_dtype: str) -> int:
    return {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2}.get(st_dtype, 1)
