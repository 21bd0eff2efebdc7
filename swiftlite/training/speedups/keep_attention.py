"""Attention kept from the forward pass for checkpointing's recompute (`--keep_attention`, CPU).

Gradient checkpointing keeps each decoder layer's input and runs the layer again inside
backward, to rebuild what backward needs. For attention that means a second flash-attention
forward, whose result is the first one's bit for bit: the recomputed q, k and v are the same
numbers (checkpointing replays the random state too), and the kernel is deterministic. On a
CPU that kernel runs at a fraction of the matmul rate (head dimension 64), so it is an
expensive thing to redo for what it takes to keep: its output and the softmax's log-sum-exp
per head, 4 x (hidden + heads) bytes per token and layer in fp32 (SmolLM2-135M: 70 KB per
token over 30 layers, as much again as checkpointing keeps).

Here packed_attention.py's per-sample attention calls CPU flash attention through _Attention,
which in the first forward keeps (output, log-sum-exp) of each sample on the attention module,
and in the recompute hands them back instead of running the kernel; backward is the kernel's
own. Only under gradient checkpointing (nothing is recomputed otherwise), in training, without
attention dropout; anything else runs SDPA as before.
"""
from __future__ import annotations

import torch

from swiftlite.training.speedups.recompute import (checkpointing, fingerprint, keep,
                                                   recomputing, same, take)

_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _Attention(torch.autograd.Function):
    """Causal flash attention of one sample, with its output given (`kept`) or computed."""

    @staticmethod
    def forward(ctx, q, k, v, scale, kept):
        out, lse = kept if kept is not None else _FORWARD(q, k, v, 0.0, True, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _BACKWARD(grad.contiguous(), q, k, v, out, lse, 0.0, True, scale=ctx.scale)
        return dq, dk, dv, None, None


def applies(module, query, dropout: float) -> bool:
    """Whether this attention call keeps or reuses its result (see the module docstring)."""
    # Not under autocast (full fine-tuning's bf16 over fp32 masters): the kernel is called
    # directly, past SDPA's own casting of q, k and v to one dtype.
    return (getattr(module, "_keep_attention", False) and query.device.type == "cpu"
            and dropout == 0.0 and checkpointing(module._block)
            and not torch.is_autocast_enabled("cpu"))


def attention(module, segments, scale):
    """Causal attention of each (q, k, v) in `segments` (one packed sample each, shared K/V
    heads read by the kernel itself): computed and kept for `module` in the forward pass, handed
    back in checkpointing's recompute (recompute.py), if it is that forward's."""
    if not recomputing():  # the forward pass
        outs = [_Attention.apply(q, k, v, scale, None) for q, k, v in segments]
        keep(module, (fingerprint(segments[0][0]), [(o.detach(), lse) for o, lse in outs]))
        return [o for o, _ in outs]
    # None: nothing kept (reentrant checkpointing runs the forward pass without gradients)
    kept = take(module)
    if kept is None or not same(kept[0], segments[0][0]):
        kept = (None, [None] * len(segments))
    return [_Attention.apply(q, k, v, scale, pair)[0]
            for (q, k, v), pair in zip(segments, kept[1])]


def keep_attention(model) -> int:
    """Mark the attention modules of `model`'s checkpointable decoder layers; returns how many."""
    from transformers.modeling_layers import GradientCheckpointingLayer
    n = 0
    for block in model.modules():
        if isinstance(block, GradientCheckpointingLayer):
            attn = getattr(block, "self_attn", None)
            if attn is not None:
                attn._keep_attention = True
                object.__setattr__(attn, "_block", block)  # a reference: the block is its parent
                n += 1
    return n
