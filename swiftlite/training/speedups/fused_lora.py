"""LoRA layers for CPU training in one autograd function (`--fused_lora`, on by default).

peft computes a LoRA layer as `base(x) + lora_B(lora_A(dropout(x))) * scaling` from stock
modules, and autograd differentiates the two small matmuls with its generic formulas. On a CPU
two of those are slow: the gradient of lora_B's weight (`g^T @ h`) and of its input (`g @ B`)
read the large output gradient g (tokens x out_features) in a layout oneDNN handles at a third
of the speed of the transposed products (`h^T @ g`, `B^T @ g^T`) that give the same numbers
(SmolLM2 gate_proj, 900 tokens: 1.04 + 0.80 ms vs 0.31 + 0.29 ms, against 4 ms for the bf16
base matmul). Here the adapter branch is one autograd function that computes its gradients in
the fast layouts, scales the small rank-r activation instead of the large output, and skips the
input gradient where nothing upstream needs it (the first layer).

The frozen base matmul is an autograd function that saves nothing (its weight is a frozen
parameter, referenced rather than saved) and runs after the adapter branch. So when gradient
checkpointing recomputes a decoder layer, torch stops the recompute once the last saved tensor
is back, before the layer's final matmul (down_proj), which peft's order makes it redo for
nothing: 1 of the 7 frozen matmuls of a layer, about a quarter of its FLOPs. With
--selective_checkpointing the other base outputs are kept from the forward pass (bf16 on a bf16
base) and handed to the recompute instead of multiplying again: no frozen matmul is recomputed,
for memory of one output per frozen matmul and token (keep_frozen_outputs below).

The numbers equal peft's to float rounding (same dropout masks: the mask is drawn from the same
generator at the same point); tests/test_speedups.py checks loss and gradients. Anything the
plain case does not cover (merged or disabled adapters, several adapters, DoRA and other
variants, lora bias, torch's own dropout with --fast_dropout false, GPUs, DeepSpeed ZeRO-3's
partitioned weights, eval mode) goes through peft's forward unchanged.
"""
from __future__ import annotations

import types

import torch

from swiftlite.training.speedups.fast_dropout import FastDropout


class _LoraBranch(torch.autograd.Function):
    """scaling * dropout(x) @ A^T @ B^T, with the gradients of x, A and B.

    Dropout zeroes the dropped elements here and its 1/keep scale joins the LoRA scaling on the
    rank-r activation h, so no pass over x multiplies by it."""

    @staticmethod
    def forward(ctx, x, a, b, scale, dropped):
        x2 = x.reshape(-1, x.shape[-1])  # (tokens, features)
        xd = x2
        if dropped is not None:  # flat positions to zero (fast_dropout.py)
            xd = x2.clone(memory_format=torch.contiguous_format)
            xd.view(-1).index_fill_(0, dropped, 0.0)
        h = torch.mm(xd, a.t()).mul_(scale)  # (tokens, r)
        # The dropped input rather than x, so backward need not drop again (the positions are
        # kept too, for the input gradient). With checkpointing these live only while their
        # decoder layer is recomputed and back-propagated.
        ctx.save_for_backward(xd, a, b, h, dropped)
        ctx.scale, ctx.x_shape = scale, x.shape
        return torch.mm(h, b.t()).view(*x.shape[:-1], b.shape[0])

    @staticmethod
    def backward(ctx, grad):
        xd, a, b, h, dropped = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        # The transposed products: the same values in the layout oneDNN is fast at (see above).
        grad_b = torch.mm(h.t(), g).t() if ctx.needs_input_grad[2] else None
        gh = torch.mm(b.t().contiguous(), g.t()).t().mul_(ctx.scale)  # d loss / d (xd @ A^T)
        grad_a = torch.mm(gh.t(), xd) if ctx.needs_input_grad[1] else None
        grad_x = None
        if ctx.needs_input_grad[0]:  # not in the first layer: nothing upstream learns
            grad_x = torch.mm(gh, a)
            if dropped is not None:
                grad_x.view(-1).index_fill_(0, dropped, 0.0)
            grad_x = grad_x.view(ctx.x_shape)
        return grad_x, grad_a, grad_b, None, None


class _FrozenLinear(torch.autograd.Function):
    """x @ W^T (+ bias) in W's dtype for a frozen W, with the gradient of x only. W is kept on
    ctx as a reference, not saved: a frozen parameter does not change within a step, and with
    nothing saved checkpointing needs nothing of this op back (see above)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.weight, ctx.x_dtype = weight, x.dtype
        return torch.nn.functional.linear(x.to(weight.dtype), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None, None
        w = ctx.weight
        g = grad.reshape(-1, grad.shape[-1]).to(w.dtype)
        return torch.mm(g, w).to(ctx.x_dtype).view(*grad.shape[:-1], w.shape[1]), None, None


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
            or base.weight.requires_grad or hasattr(base.weight, "ds_id")  # ZeRO-3: partitioned
            or not (isinstance(dropout, (FastDropout, torch.nn.Identity))
                    or (type(dropout) is torch.nn.Dropout and dropout.p == 0))):
        return None
    return name


def _fused_forward(self, x, *args, **kwargs):
    name = _plain(self, x, args, kwargs)
    if name is None:
        return self._peft_forward(x, *args, **kwargs)
    dropout, scale, dropped = self.lora_dropout[name], self.scaling[name], None
    if isinstance(dropout, FastDropout):
        dropped = dropout.positions(x.shape)
        if dropped is not None:
            scale *= dropout.keep_scale
    lora = _LoraBranch.apply(x, self.lora_A[name].weight, self.lora_B[name].weight, scale,
                             dropped)
    # The base matmul after the adapter branch, so checkpointing's recompute can stop before it
    # (see above). A bf16 base (fp32 activations, see fp32_activations.py) returns bf16 and the sum
    # with the fp32 branch is fp32: no separate pass to cast the base output.
    return _base_output(self, x) + lora


def _base_output(layer, x):
    """The frozen matmul, or its output kept from the forward pass when checkpointing
    recomputes it (--selective_checkpointing: keep_frozen_outputs)."""
    keep = layer._keep_output and torch.is_grad_enabled()
    # Checkpointing recomputes a layer from inside backward, where a graph task is running.
    in_backward = keep and torch._C._current_graph_task_id() != -1
    if in_backward and layer._kept is not None:
        kept, layer._kept = layer._kept, None
        return kept
    base = layer.base_layer
    out = _FrozenLinear.apply(x, base.weight, base.bias)
    if keep and not in_backward:
        layer._kept = out.detach()
    return out


def use_fused_lora(model) -> int:
    """Route the training forward of peft's LoRA Linear layers through _LoraBranch; returns how
    many layers."""
    from peft.tuners.lora.layer import Linear
    n = 0
    for module in model.modules():
        if type(module) is Linear and "_peft_forward" not in vars(module):
            module._peft_forward = module.forward
            module.forward = types.MethodType(_fused_forward, module)
            module._keep_output, module._kept = False, None
            n += 1
    return n


def keep_frozen_outputs(model) -> int:
    """--selective_checkpointing with fused LoRA layers: each checkpointed decoder layer keeps
    its base outputs from the forward pass for the recompute, except the layer's last one
    (down_proj), which the recompute never reaches. Returns how many layers keep theirs."""
    from peft.tuners.lora.layer import Linear
    from transformers.modeling_layers import GradientCheckpointingLayer
    n = 0
    for block in model.modules():
        if isinstance(block, GradientCheckpointingLayer):
            fused = [m for m in block.modules() if type(m) is Linear and "_peft_forward" in vars(m)]
            for m in fused[:-1]:  # in registration order, which is the forward's (q ... down)
                m._keep_output = True
                n += 1
    return n
