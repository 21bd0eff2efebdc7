"""A LoRA adapter merged inside llama.cpp's converter, one weight at a time as it is written.

The other way to export an adapter, merging it into a 16-bit model folder first (the streaming
merge) and converting that folder, reads and writes the model one more time and holds torch in
two processes. Here llama.cpp's converter reads the base model's own safetensors files, and
each adapted weight is computed as W + scale * B @ A, in fp32, when the converter writes it
(llamacpp_child.py): the converter stays lazy, so memory stays about one tensor, and the GGUF
gets the fp32 sums rounded once to its type.

This handles LoRA (and rsLoRA) on linear layers, which is what swiftlite trains unless told
otherwise. For anything else (DoRA, embeddings, modules_to_save, a tied lm_head, an adapter
that does not match its base) plan() returns None and the caller merges into a folder, where
such adapters are merged or refused with a message.

The converter reads a folder of links (model_view): the base model's configuration and weight
files, the checkpoint's tokenizer. Nothing here imports torch or transformers.
"""
from __future__ import annotations

import json
import os
import re

from swiftlite.export.streaming_merge import ADAPTER_PREFIX, PEFT_ONLY, lora_scale
from swiftlite.models.safetensors_files import base_index, read_header, tensor_meta

_LORA = re.compile(re.escape(ADAPTER_PREFIX) + r"(.+)\.lora_([AB])\.weight")


def plan(ckpt_dir: str, base_dir: str) -> dict | None:
    """The merge job for llamacpp_child.py ({"adapter": file, "deltas": {base weight: {"A",
    "B": adapter tensor names, "scale"}}}), or None when the adapter needs a folder merge."""
    with open(os.path.join(ckpt_dir, "adapter_config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    adapter = os.path.join(ckpt_dir, "adapter_model.safetensors")
    if (cfg.get("peft_type", "LORA") != "LORA" or cfg.get("fan_in_fan_out")
            or any(cfg.get(k) for k in PEFT_ONLY) or not os.path.exists(adapter)):
        return None
    pairs: dict[str, dict] = {}
    for key, (_, shape) in read_header(adapter).items():
        m = _LORA.fullmatch(key)
        if not m:
            return None
        pairs.setdefault(m.group(1), {})[m.group(2)] = (key, shape)
    meta = tensor_meta(base_index(base_dir))
    deltas = {}
    for module, p in sorted(pairs.items()):
        if set(p) != {"A", "B"}:
            return None
        (a_key, a_shape), (b_key, b_shape) = p["A"], p["B"]
        weight = module + ".weight"
        if (weight not in meta or a_shape[0] != b_shape[1]
                or meta[weight][1] != [b_shape[0], a_shape[1]]):
            return None
        deltas[weight] = {"A": a_key, "B": b_key, "scale": lora_scale(module, cfg, a_shape[0])}
    return {"adapter": os.path.abspath(adapter), "deltas": deltas} if deltas else None


# The files of a transformers tokenizer (any of them may be absent)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "chat_template.jinja", "chat_template.json")


def model_view(base_dir: str, tokenizer_dir: str, out_dir: str) -> None:
    """The folder the converter reads: links to the base model's configuration and weight
    files and to the checkpoint's tokenizer files. The GGUF's chat template and end-of-turn
    token are the checkpoint's whatever these files say (llamacpp_child.py sets them)."""
    files = {os.path.basename(p): base_dir for p in base_index(base_dir).values()}
    for name in ("model.safetensors.index.json", "config.json", "generation_config.json"):
        if os.path.exists(os.path.join(base_dir, name)):
            files[name] = base_dir
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(tokenizer_dir, name)):
            files[name] = tokenizer_dir
    os.makedirs(out_dir)
    for name, folder in sorted(files.items()):
        os.symlink(os.path.abspath(os.path.join(folder, name)), os.path.join(out_dir, name))
