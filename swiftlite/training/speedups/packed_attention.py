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

import torch
import torch.nn.functional as F

NAME = "sdpa_packed"
_HAS_GQA = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)  # enable_gqa


def _segments(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each packed sample in one row: a sample starts where the position
    does not continue the previous one."""
    starts = torch.nonzero(position_ids[1:] != position_ids[:-1] + 1).flatten() + 1
    bounds = [0, *starts.tolist(), position_ids.shape[0]]
    return list(zip(bounds[:-1], bounds[1:]))


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
    if groups > 1 and _HAS_GQA:  # SDPA reads the shared K/V heads itself: no repeated copies
        gqa = {"enable_gqa": True}
    elif groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    rows = []
    for b in range(query.shape[0]):
        pos = position_ids[b if position_ids.shape[0] > 1 else 0]
        parts = [F.scaled_dot_product_attention(
            query[b:b + 1, :, s:e], key[b:b + 1, :, s:e], value[b:b + 1, :, s:e],
            dropout_p=dropout, scale=scaling, is_causal=True, **gqa) for s, e in _segments(pos)]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    out = rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)
    return out.transpose(1, 2).contiguous(), None


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
