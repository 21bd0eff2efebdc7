"""Merge a LoRA adapter into the base model's safetensors files one tensor at a time.

peft's `merge_and_unload` needs the whole model in memory (and `save_pretrained` then builds
each output shard in memory too). Here every output tensor is read from the base files, merged
in fp32 (W += scale * B @ A), cast to the output dtype and written straight into its place in a
pre-sized safetensors file, so peak memory is about the largest single tensor plus the adapter,
whatever the model size.

The output files are standard safetensors: the header (names, dtypes, shapes, offsets) is known
before any tensor is read, so it is written first and the data streamed after it.

Tied embeddings (lm_head shares embed_tokens, as in SmolLM2 and small Qwen2 models): when LoRA
changes one side only, the two weights differ after merging, so the merged model is written
untied (an lm_head.weight of its own, tie_word_embeddings false).

Adapters using features this merger does not implement (DoRA, LoRA bias, modules_to_save,
trainable tokens, LoRA on parameters) raise Unsupported; the caller falls back to peft.
"""
from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass, field

from swiftlite.errors import UsageError
from swiftlite.models.safetensors_files import element_size

ADAPTER_PREFIX = "base_model.model."
_DTYPE_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64",
                "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
                "bool": "BOOL"}


class Unsupported(Exception):
    """The adapter uses a peft feature that only peft's own merge handles."""


@dataclass
class Delta:
    A: object  # torch tensors, fp32
    B: object
    scale: float
    kind: str  # "linear" | "embedding"
    fan_in_fan_out: bool = False

    def apply_(self, w):
        """w += scale * (B @ A) in place, in the layout of w (no full-size temporary)."""
        if self.kind == "embedding":  # w: [vocab, dim]; A: [r, vocab]; B: [dim, r]
            return w.addmm_(self.A.T, self.B.T, alpha=self.scale)
        if self.fan_in_fan_out:  # Conv1D-style weights are stored [in, out]
            return w.addmm_(self.A.T, self.B.T, alpha=self.scale)
        return w.addmm_(self.B, self.A, alpha=self.scale)  # w: [out, in]


@dataclass
class MergePlan:
    deltas: dict[str, Delta]  # base weight name -> delta
    replaced: dict[str, object]  # base weight name -> tensor saved with the adapter
    untie: tuple[str, str] | None = None  # (lm_head weight, embedding weight) to write apart
    outputs: list[tuple[str, str]] = field(default_factory=list)  # (output name, source name)


def read_adapter(ckpt_dir: str) -> tuple[dict, dict]:
    from safetensors.torch import load_file
    cfg_path = os.path.join(ckpt_dir, "adapter_config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    path = os.path.join(ckpt_dir, "adapter_model.safetensors")
    if not os.path.exists(path):
        raise UsageError(f"{ckpt_dir}: no adapter_model.safetensors next to adapter_config.json "
                         "(the checkpoint is incomplete).")
    try:
        tensors = load_file(path)
    except Exception as e:
        raise UsageError(f"{path}: not a readable safetensors file ({e}); the checkpoint is "
                         "corrupt or truncated.") from None
    return cfg, tensors


# -- planning --------------------------------------------------------------------------------
# adapter_config.json keys of peft features that only peft's own merge implements
PEFT_ONLY = ("use_dora", "lora_bias", "modules_to_save", "trainable_token_indices",
             "target_parameters", "layer_replication")


def lora_scale(module: str, cfg: dict, r: int) -> float:
    """peft's scaling of module's B @ A: lora_alpha (or its alpha_pattern entry, a pattern that
    matches the end of the module name) over r, or over sqrt(r) with rsLoRA."""
    import math
    alpha = cfg["lora_alpha"]
    for pattern, value in (cfg.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            alpha = value
            break
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def plan_merge(cfg: dict, tensors: dict, meta: dict, config, embed_names: tuple[str, str] | None
               ) -> MergePlan:
    """Check the adapter against the base tensors (names and shapes) and pair up A/B."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise Unsupported(f"peft_type {cfg.get('peft_type')}")
    for key in PEFT_ONLY:
        if cfg.get(key):
            raise Unsupported(key)
    pairs: dict[str, dict] = {}
    replaced = {}
    for key, t in tensors.items():
        if not key.startswith(ADAPTER_PREFIX):
            raise Unsupported(f"tensor {key}")
        name = key[len(ADAPTER_PREFIX):]
        m = re.fullmatch(r"(.+)\.(lora_A|lora_B)\.weight|(.+)\.(lora_embedding_A|lora_embedding_B)"
                         r"|(.+)\.base_layer\.weight", name)
        if not m:
            raise Unsupported(f"tensor {key}")
        if m.group(5):  # an embedding layer saved whole with the adapter (peft does when it is
            replaced[m.group(5) + ".weight"] = t  # targeted, e.g. after resizing the vocab)
            continue
        module = m.group(1) or m.group(3)
        part = (m.group(2) or m.group(4))[-1]
        pairs.setdefault(module, {})[part] = t
        pairs[module]["kind"] = "embedding" if m.group(3) else "linear"

    tied = bool(embed_names) and getattr(config, "tie_word_embeddings", False) and \
        embed_names[1] not in meta
    deltas, problems = {}, []
    for module, p in sorted(pairs.items()):
        if "A" not in p or "B" not in p:
            raise UsageError(f"the adapter has lora_{'A' if 'A' not in p else 'B'} missing for "
                             f"{module}; the checkpoint is incomplete.")
        weight = module + ".weight"
        src = embed_names[0] if tied and weight == embed_names[1] else weight
        if src not in meta:
            problems.append(f"the adapter adapts {module}, which the base model does not have")
            continue
        A, B = p["A"].float(), p["B"].float()
        shape = meta[src][1]
        fifo = bool(cfg.get("fan_in_fan_out")) and p["kind"] == "linear"
        if p["kind"] == "embedding":
            want = [A.shape[1], B.shape[0]]
        else:
            want = [B.shape[0], A.shape[1]] if not fifo else [A.shape[1], B.shape[0]]
        if A.shape[0] != B.shape[1] or list(shape) != want:
            problems.append(f"{module}: the adapter expects a {want[0]}x{want[1]} weight, the "
                            f"base model has {'x'.join(map(str, shape))}")
            continue
        deltas[weight] = Delta(A, B, lora_scale(module, cfg, A.shape[0]), p["kind"], fifo)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise UsageError("the adapter does not match the base model: " + "; ".join(problems[:3])
                         + more + ". Pass --model with the base model this checkpoint was "
                         "trained from.")

    plan = MergePlan(deltas, replaced)
    outputs = [(k, k) for k in meta]
    if tied and (embed_names[1] in deltas or embed_names[0] in deltas):
        # The adapter model computes logits with the original shared weight plus the lm_head
        # delta (if any), and embeddings with the embedding delta (if any): two weights now.
        plan.untie = (embed_names[1], embed_names[0])
        outputs.append((embed_names[1], embed_names[0]))
    plan.outputs = outputs
    return plan


# -- writing ---------------------------------------------------------------------------------
class StreamingSafetensorsWriter:
    """Writes one safetensors file whose tensors arrive one by one (sizes known up front)."""

    def __init__(self, path: str, entries: list[tuple[str, str, list[int], int]]):
        header, offset = {}, 0
        for name, dtype, shape, nbytes in entries:
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the format pads the header to 8-byte alignment
        self.f = open(path, "wb")
        self.f.write(struct.pack("<Q", len(raw)) + raw)
        self.expected = [(n, nb) for n, _, _, nb in entries]
        self.i = 0

    def write(self, name: str, tensor) -> None:
        import torch
        want, nbytes = self.expected[self.i]
        data = tensor.contiguous().view(-1).view(torch.uint8).numpy()
        if name != want or data.nbytes != nbytes:
            raise RuntimeError(f"safetensors writer: got {name} ({data.nbytes} bytes), expected "
                               f"{want} ({nbytes} bytes)")
        self.f.write(memoryview(data))
        self.i += 1

    def close(self) -> None:
        self.f.close()
        if self.i != len(self.expected):
            raise RuntimeError("safetensors writer: file closed before all tensors were written")


def write_merged(out_dir: str, plan: MergePlan, index: dict[str, str], meta: dict, out_dtype,
                 max_shard_size: int, progress: bool = True) -> dict:
    """Stream every output tensor into safetensors shards under out_dir; returns stats."""
    import torch
    from safetensors import safe_open
    from tqdm import tqdm
    out_st = _DTYPE_NAMES[str(out_dtype).removeprefix("torch.")]

    def out_entry(name, src):
        st, shape = meta[src]
        if st in ("F32", "F16", "BF16", "F64"):
            st = out_st
        n = 1
        for d in shape:
            n *= d
        return name, st, shape, n * element_size(st)

    entries = [out_entry(n, s) for n, s in plan.outputs]
    shards, cur, size = [], [], 0
    for e in entries:  # greedy packing in the base order, like save_pretrained
        if cur and size + e[3] > max_shard_size:
            shards.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += e[3]
    shards.append(cur)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    src_of = dict(plan.outputs)
    bar = tqdm(total=len(entries), desc="merging", unit="tensor", disable=not progress)
    try:
        for fname, shard in zip(names, shards):
            writer = StreamingSafetensorsWriter(os.path.join(out_dir, fname), shard)
            for name, st, _, _ in shard:
                src = src_of[name]
                t = plan.replaced.get(name, plan.replaced.get(src))
                kept = t is not None
                if t is None:
                    # safetensors maps the whole file and hands out tensors backed by the map;
                    # pages once touched stay resident while the file is open. One open per
                    # tensor releases them with the tensor, so memory stays at one tensor.
                    with safe_open(index[src], "pt") as f:
                        t = f.get_tensor(src)
                if t.is_floating_point():
                    # .to() copies only when the dtype changes; a tensor kept in plan.replaced
                    # is copied so that it is never modified in place.
                    t = t.to(torch.float32, copy=kept)
                    delta = plan.deltas.get(name)
                    if delta is not None:
                        delta.apply_(t)
                    t = t.to(out_dtype)
                writer.write(name, t)
                del t
                bar.update(1)
            writer.close()
    finally:
        bar.close()
    if len(shards) > 1:
        weight_map = {e[0]: fname for fname, shard in zip(names, shards) for e in shard}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sum(e[3] for e in entries)},
                       "weight_map": weight_map}, f, indent=2)
    return {"files": names, "tensors": len(entries), "merged": len(plan.deltas),
            "bytes": sum(e[3] for e in entries), "untied": plan.untie is not None}
