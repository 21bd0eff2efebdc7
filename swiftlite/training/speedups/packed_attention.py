"""Attention for padding-free batches without flash-attention: SDPA per packed sample.

With plain SDPA, transformers turns a packed row (position_ids restarting at 0 per sample)
into one block-diagonal T x T mask and attends over the whole row: for 4 samples that is
about 4x the attention work of the samples alone, and CPU SDPA with an explicit mask is a
slow kernel. Here each sample's slice runs through SDPA with `is_causal=True` and no mask
(what flash-attention's varlen kernels do on GPUs): the same numbers, less work.

Registered as the attention implementation "sdpa_packed", used for training only
(tuners.prepare_model sets it when --padding_free is on and the model uses sdpa). It is not
registered as a mask function, so transformers builds no mask for it: correct for
padding-free batches, which have no padding. Anything with a mask or a cache (generation)
is handed to the stock SDPA function unchanged.
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from swiftlite.training.speedups import keep_attention

NAME = "sdpa_packed"
_HAS_GQA = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)  # enable_gqa


# (position_ids tensor, its rows' segments): the batch in flight in this thread (with
# --batch_threads each part of a batch runs in a thread of its own)
_last = threading.local()


def _segments(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each packed sample in one row: a sample starts where the position
    does not continue the previous one."""
    starts = torch.nonzero(position_ids[1:] != position_ids[:-1] + 1).flatten() + 1
    bounds = [0, *starts.tolist(), position_ids.shape[0]]  # .tolist(): a host sync on a GPU
    return list(zip(bounds[:-1], bounds[1:]))


def _row_segments(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """_segments of each row, computed once per batch: every layer (and its recompute under
    gradient checkpointing) is given the same position_ids tensor, so the host sync of
    reading the boundaries happens once per forward, not once per layer."""
    pair = getattr(_last, "pair", None)
    if pair is None or pair[0] is not position_ids:
        pair = _last.pair = (position_ids, [_segments(row) for row in position_ids])
    return pair[1]


def gqa_in_kernel(device_type: str, dtype: torch.dtype, capability=None) -> bool:
    """Whether SDPA's kernel for these inputs reads shared K/V heads itself (enable_gqa).
    CPU: its flash kernel does. CUDA: only the flash kernel (Ampere+, 16-bit); on a T4/V100
    or in fp32 the memory-efficient kernel would refuse it and SDPA would fall to the math
    kernel (length x length memory), so the K/V heads are repeated instead, as on NPUs."""
    if not _HAS_GQA:
        return False
    if device_type == "cpu":
        return True
    return (device_type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and capability is not None and tuple(capability) >= (8, 0))


def packed_sdpa_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                        scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
    position_ids = kwargs.get("position_ids")
    q_len = query.shape[2]
    if (attention_mask is not None or position_ids is None or q_len != key.shape[2]
            or q_len == 1 or kwargs.get("position_bias") is not None
            or not getattr(module, "is_causal", True)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    gqa = {}
    if groups > 1 and gqa_in_kernel(query.device.type, query.dtype, _capability(query)):
        gqa = {"enable_gqa": True}  # SDPA reads the shared K/V heads itself: no copies
    elif groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    segments = _row_segments(position_ids)
    rows = [[(query[b:b + 1, :, s:e], key[b:b + 1, :, s:e], value[b:b + 1, :, s:e])
             for s, e in segments[b if len(segments) > 1 else 0]] for b in range(query.shape[0])]
    if keep_attention.applies(module, query, dropout):
        flat = iter(keep_attention.attention(module, [qkv for row in rows for qkv in row],
                                             scaling))
        outs = [[next(flat) for _ in row] for row in rows]
    else:
        outs = [[F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling,
                                                is_causal=True, **gqa) for q, k, v in row]
                for row in rows]
    rows = [parts[0] if len(parts) == 1 else torch.cat(parts, dim=2) for parts in outs]
    out = rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)
    return out.transpose(1, 2).contiguous(), None


def _capability(t: torch.Tensor):
    return torch.cuda.get_device_capability(t.device) if t.device.type == "cuda" else None


def register() -> str:
    from transformers import AttentionInterface
    AttentionInterface.register(NAME, packed_sdpa_forward)
    return NAME


def use_packed_attention(model) -> bool:
    """Switch a model that runs stock SDPA to the per-sample version; False if it does not."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    register()
    model.set_attn_implementation(NAME)
    return True
