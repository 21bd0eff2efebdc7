"""LoRA layers for CPU training in one autograd function (`--fused_lora`, on by default).

peft computes a LoRA layer as `base(x) + lora_B(lora_A(dropout(x))) * scaling` from stock
modules, and autograd differentiates the two small matmuls with its generic formulas. On a CPU
two of those are slow: the gradient of lora_B's weight (`g^T @ h`) and of its input (`g @ B`)
read the large output gradient g (tokens x out_features) in a layout oneDNN handles at a third
of the speed of the transposed products (`h^T @ g`, `B^T @ g^T`) that give the same numbers
(SmolLM2 gate_proj, 900 tokens: 1.04 + 0.80 ms vs 0.31 + 0.29 ms, against 4 ms for the bf16
base matmul). Here the adapter branch is one autograd function that computes its gradients in
the fast layouts, scales the small rank-r activation instead of the large output, keeps the
dropout mask (1 byte per element) rather than the dropped input, and skips the input gradient
where nothing upstream needs it (the first layer).

The base matmul runs after the adapter branch. Its output is needed only to be added to the
result, so when gradient checkpointing recomputes a decoder layer, torch stops the recompute
once the last saved tensor is back and never redoes the layer's final matmul (down_proj): 1 of
the 7 frozen matmuls per layer recomputed for nothing (about a quarter of the layer's FLOPs).

The numbers equal peft's to float rounding (same dropout masks: the mask is drawn from the same
generator at the same point); tests/test_speedups.py checks loss and gradients. Anything the
plain case does not cover (merged or disabled adapters, several adapters, DoRA and other
variants, lora bias, torch's own dropout with --fast_dropout false, GPUs, DeepSpeed ZeRO-3's
partitioned weights, eval mode) goes through peft's forward unchanged.
"""
from __future__ import annotations

import types

import torch

from .dropout import FastDropout


class _LoraBranch(torch.autograd.Function):
    """scaling * dropout(x) @ A^T @ B^T, with the gradients of x, A and B.

    Dropout zeroes the dropped elements here and its 1/keep scale joins the LoRA scaling on the
    rank-r activation h, so no pass over x multiplies by it."""

    @staticmethod
    def forward(ctx, x, a, b, scale, drop):
        x2 = x.reshape(-1, x.shape[-1])
        xd = x2 if drop is None else torch.where(drop.view(x2.shape), 0.0, x2)
        h = torch.mm(xd, a.t()).mul_(scale)  # (tokens, r)
        ctx.save_for_backward(x, a, b, h, drop)  # the mask, not the dropped x: 1 byte/element
        ctx.scale = scale
        return torch.mm(h, b.t()).view(*x.shape[:-1], b.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, a, b, h, drop = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        # The transposed products: the same values in the layout oneDNN is fast at (see above).
        grad_b = torch.mm(h.t(), g).t() if ctx.needs_input_grad[2] else None
        gh = torch.mm(b.t().contiguous(), g.t()).t().mul_(ctx.scale)  # d loss / d (xd @ A^T)
        grad_a = grad_x = None
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            grad_a = torch.mm(gh.t(), x2 if drop is None else
                              torch.where(drop.view(x2.shape), 0.0, x2))
        if ctx.needs_input_grad[0]:  # not in the first layer: nothing upstream learns
            grad_x = torch.mm(gh, a)
            if drop is not None:
                grad_x.masked_fill_(drop.view(grad_x.shape), 0.0)
            grad_x = grad_x.view(x.shape)
        return grad_x, grad_a, grad_b, None, None


def _plain(layer, x, args, kwargs):
    """The adapter of `layer` when the fused path covers this call, else None."""
    if (args or kwargs or not layer.training or layer.disable_adapters or layer.merged
            or x.device.type != "cpu" or len(layer.active_adapters) != 1):
        return None
    name = layer.active_adapters[0]
    if name not in layer.lora_A or name in getattr(layer, "lora_variant", {}):
        return None
    a, b, base = layer.lora_A[name], layer.lora_B[name], layer.base_layer
    dropout = layer.lora_dropout[name]
    if (type(base) is not torch.nn.Linear or base._forward_hooks or base._forward_pre_hooks
            or b.bias is not None or a.weight.dtype != x.dtype or b.weight.dtype != x.dtype
            or hasattr(base.weight, "ds_id")  # ZeRO-3: DeepSpeed's hooks gather the weights
            or not (isinstance(dropout, (FastDropout, torch.nn.Identity))
                    or (type(dropout) is torch.nn.Dropout and dropout.p == 0))):
        return None
    return name


def _fused_forward(self, x, *args, **kwargs):
    name = _plain(self, x, args, kwargs)
    if name is None:
        return self._peft_forward(x, *args, **kwargs)
    dropout, scale, drop = self.lora_dropout[name], self.scaling[name], None
    if isinstance(dropout, FastDropout):
        drop = dropout.mask(x.shape)
        if drop is not None:
            scale *= dropout.keep_scale
    lora = _LoraBranch.apply(x, self.lora_A[name].weight, self.lora_B[name].weight, scale, drop)
    # The base matmul after the adapter branch, so checkpointing's recompute can stop before it
    # (see above). A bf16 base (fp32 activations, see precision.py) returns bf16 and the sum
    # with the fp32 branch is fp32: no separate pass to cast the base output.
    w = self.base_layer.weight
    return torch.nn.functional.linear(x.to(w.dtype), w, self.base_layer.bias) + lora


def use_fused_lora(model) -> int:
    """Route the training forward of peft's LoRA Linear layers through _LoraBranch; returns how
    many layers."""
    from peft.tuners.lora.layer import Linear
    n = 0
    for module in model.modules():
        if type(module) is Linear and "_peft_forward" not in vars(module):
            module._peft_forward = module.forward
            module.forward = types.MethodType(_fused_forward, module)
            n += 1
    return n
