"""Selective gradient checkpointing (`--selective_checkpointing`; here only when asked for), by
torch's policy mechanism. Fused LoRA layers (fused_lora.py, the default) keep their frozen outputs
themselves, without this mechanism's cost of a Python dispatch hook on every op (figures in
docs/performance.md); this is for LoRA elsewhere: GPUs, ZeRO-3,
--fused_lora false. Full fine-tuning has no frozen matmuls, so prepare_model says so and keeps
plain checkpointing.

Plain checkpointing keeps each decoder layer's input and recomputes the whole layer in
backward: every frozen matmul runs twice forward and once backward, so a third of the matmul
work is recomputation. The frozen matmuls are the expensive part of that recomputation, and
the cheap one to avoid: this policy keeps the outputs of matmuls whose weight is frozen
(torch's selective activation checkpointing) and recomputes everything else (norms, rotary,
attention, activations, dropout with its replayed masks, the small LoRA matmuls). The numbers
are the same as plain checkpointing; the price is memory: 7 matmul outputs per layer and token
(SmolLM2-135M: 5,184 values, about 0.6 MB per token over 30 layers in fp32, half in bf16),
which is why it is opt-in here.
"""
from __future__ import annotations

import functools

import torch

_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def _keep_frozen_matmuls(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy
    # mm(x, W^T) / addmm(bias, x, W^T): the weight is the last tensor; frozen = no grad.
    if op in _MATMULS and isinstance(args[-1], torch.Tensor) and not args[-1].requires_grad:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_kwargs(selective: bool) -> dict:
    """kwargs for torch.utils.checkpoint.checkpoint, as transformers passes them on."""
    kwargs = {"use_reentrant": False}
    if selective:
        from torch.utils.checkpoint import create_selective_checkpoint_contexts
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts,
                                                 _keep_frozen_matmuls)
    return kwargs
