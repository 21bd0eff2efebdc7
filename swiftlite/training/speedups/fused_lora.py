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

The frozen base matmul and the branch are one function too, whose sum is the branch's last
matmul accumulating into the base output (and likewise the input gradients in backward), so
autograd adds no pass of its own. The exception is the last LoRA layer of each checkpointable
decoder layer (down_proj): there the base matmul is a function that saves nothing (its weight is
a frozen parameter, referenced rather than saved) and runs after the adapter branch. So when
gradient checkpointing recomputes a decoder layer, torch stops the recompute once the last
saved tensor is back, before that final matmul, which peft's order makes it redo for nothing: 1
of the 7 frozen matmuls of a layer, about a quarter of its FLOPs. With --selective_checkpointing
the other base outputs are kept from the forward pass (bf16 on a bf16 base) and handed to the
recompute instead of multiplying again: no frozen matmul is recomputed, for memory of one
output per frozen matmul and token (keep_frozen_outputs below); by default only as many
decoder layers keep theirs as fit in a memory budget, the others recompute. Every layer also
keeps its dropout's drop positions and its rank-r activation (x @ A^T) for the recompute, which
then draws no dropout and multiplies no lora_A again (the positions are about p of the input's
elements, the activation r values per token).

The numbers equal peft's to float rounding (same dropout masks: the mask is drawn from the same
generator at the same point); tests/unit/test_fused_lora.py checks loss and gradients. Anything the
plain case does not cover (merged or disabled adapters, several adapters, DoRA and other
variants, lora bias, torch's own dropout with --fast_dropout false, GPUs, DeepSpeed ZeRO-3's
partitioned weights, eval mode) goes through peft's forward unchanged.
"""
from __future__ import annotations

import threading
import types
from typing import NamedTuple

import torch

from swiftlite.training.speedups import onednn_fp32
from swiftlite.training.speedups.batch_threads import generator, share
from swiftlite.training.speedups.fast_dropout import FastDropout
from swiftlite.training.speedups.recompute import (checkpointing, fingerprint, keep,
                                                   recomputing, same, take)


class _LoraLinear(torch.autograd.Function):
    """x @ W^T (+ bias) + scaling * dropout(x) @ A^T @ B^T, with the gradients of x, A and B;
    without a frozen weight W, the adapter branch alone.

    Dropout zeroes the dropped elements here and its 1/keep scale joins the LoRA scaling on the
    rank-r activation h, so no pass over x multiplies by it. The frozen matmul's output (bf16 on
    a bf16 base, see fp32_activations.py) is cast to the activations' dtype once and the branch
    is added into it by its last matmul (`addmm_`); backward likewise adds the branch's input
    gradient into the frozen matmul's. Separate functions summed by autograd would spend two
    passes on each sum (on CPU a bf16 + fp32 add first casts its bf16 input in a pass of its own).

    `mm_dtype` bf16 with fp32 activations (--bf16_lora_matmuls): the adapter's products that
    read a whole activation (x @ A^T and the three gradients with it) take bf16 inputs, the
    same bf16 copies of x and of the output gradient that the frozen matmul uses, accumulate
    in fp32 and round their results (h, the weight gradients) to bf16 once; those are then held
    in fp32, and the sums into the output and the input gradient, the weights and the optimizer
    state are fp32 throughout (the rounding is relative to the adapter's own terms, not to the
    base output, so small updates are not rounded away). Otherwise mm_dtype is x's dtype and
    nothing is cast."""

    @staticmethod
    def forward(ctx, x, a, b, scale, dropped, mm_dtype, frozen, h=None):
        """`dropped`: flat positions of x to zero (fast_dropout.py), or None. `frozen`: None for
        the adapter branch alone, else (weight, bias, kept, keep); for --selective_checkpointing
        (keep_frozen_outputs) `kept` is the frozen matmul's output kept from the forward pass
        (None: multiply), and `keep` returns it as the second output, to keep it for the
        recompute (else the second output is None). `h`: the scaled rank-r activation the
        forward pass computed, given to the recompute (None: multiply); the third output."""
        ctx.set_materialize_grads(False)  # no zeros for the second output's gradient
        x2 = x.reshape(-1, x.shape[-1])  # (tokens, features)
        xm = x2.to(mm_dtype)  # x itself when no cast is asked for
        xd = xm
        if dropped is not None:
            xd = xm.clone(memory_format=torch.contiguous_format)
            xd.view(-1).index_fill_(0, dropped, 0.0)
        if h is None:  # (tokens, r), from A @ x^T: oneDNN's fast layout for this product
            h = torch.mm(a.to(mm_dtype), xd.t()).t().to(x.dtype).mul_(scale)
        # The dropped input rather than x, so backward need not drop again (the positions are
        # kept too, for the input gradient). With checkpointing these live only while their
        # decoder layer is recomputed and back-propagated.
        ctx.save_for_backward(xd, a, b, h, dropped)
        ctx.scale, ctx.x_shape, ctx.mm_dtype = scale, x.shape, mm_dtype
        ctx.weight = None if frozen is None else frozen[0]
        ctx.mark_non_differentiable(h)
        shape = (*x.shape[:-1], b.shape[0])
        if frozen is None:
            return torch.mm(h, b.t()).view(shape), None, h
        weight, bias, base, keep = frozen
        if base is None:
            base = onednn_fp32.linear(xm.to(weight.dtype), weight, bias)
        out = base.to(x.dtype, copy=keep).addmm_(h, b.t()).view(shape)
        if not keep:
            return out, None, h
        ctx.mark_non_differentiable(base)
        return out, base, h

    @staticmethod
    def backward(ctx, grad, _grad_base, _grad_h):
        xd, a, b, h, dropped = ctx.saved_tensors
        w, mm = ctx.weight, ctx.mm_dtype
        g = grad.reshape(-1, grad.shape[-1])
        gm = g.to(mm)
        # The transposed products: the same values in the layout oneDNN is fast at (see above).
        grad_b = (torch.mm(h.t().to(mm), gm).t().to(g.dtype) if ctx.needs_input_grad[2]
                  else None)
        gh = torch.mm(b.t().to(mm).contiguous(), gm.t()).t()  # d loss / d (xd @ A^T) / scale
        grad_a = (torch.mm(gh.t(), xd).to(g.dtype).mul_(ctx.scale) if ctx.needs_input_grad[1]
                  else None)
        grad_x = None
        if ctx.needs_input_grad[0]:  # not in the first layer: nothing upstream learns
            gh = gh.to(g.dtype).mul_(ctx.scale)
            if w is None:
                grad_x = torch.mm(gh, a)
                if dropped is not None:
                    grad_x.view(-1).index_fill_(0, dropped, 0.0)
            else:
                grad_x = onednn_fp32.mm(gm.to(w.dtype), w).to(g.dtype)
                # The branch's input was zeroed at the drops, so its gradient adds nothing there
                at_drops = None if dropped is None else grad_x.view(-1)[dropped]
                grad_x.addmm_(gh, a)
                if at_drops is not None:
                    grad_x.view(-1).index_copy_(0, dropped, at_drops)
            grad_x = grad_x.view(ctx.x_shape)
        return grad_x, grad_a, grad_b, None, None, None, None, None


class _FrozenLinear(torch.autograd.Function):
    """x @ W^T (+ bias) in W's dtype for a frozen W, with the gradient of x only. W is kept on
    ctx as a reference, not saved: a frozen parameter does not change within a step, and with
    nothing saved checkpointing needs nothing of this op back (see above)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.weight, ctx.x_dtype = weight, x.dtype
        return onednn_fp32.linear(x.to(weight.dtype), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None, None
        w = ctx.weight
        g = grad.reshape(-1, grad.shape[-1]).to(w.dtype)
        return (onednn_fp32.mm(g, w).to(ctx.x_dtype).view(*grad.shape[:-1], w.shape[1]), None,
                None)


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


class _Kept(NamedTuple):
    """What a fused layer's forward pass under checkpointing keeps for its recompute: its
    input's fingerprint (recompute.py), the random state before and after its dropout draw,
    the drop positions (int32 when they fit: half the bytes), the rank-r activation h, and the
    frozen matmul's output where --selective_checkpointing keeps it (else None)."""
    seen: tuple
    before: torch.Tensor
    dropped: torch.Tensor | None
    h: torch.Tensor
    after: torch.Tensor | None
    base: torch.Tensor | None


def _fused_forward(self, x, *args, **kwargs):
    name = _plain(self, x, args, kwargs)
    if name is None:
        keep(self, None)  # nothing kept may reach a later recompute on the fused path
        return self._peft_forward(x, *args, **kwargs)
    dropout, scale = self.lora_dropout[name], self.scaling[name]
    checkpointed = checkpointing(self._block)
    recompute = checkpointed and recomputing()
    dropped, h, kept = _taken(self, x) if recompute else (None, None, None)
    record = checkpointed and not recompute
    # A part of a --batch_threads step draws from a generator of its own, which no
    # checkpointing replays: its recompute takes the kept drops without comparing states.
    before = torch.get_rng_state() if record and generator() is None else None
    if h is None and isinstance(dropout, FastDropout):
        dropped = dropout.positions(x.shape)
    if dropped is not None:
        scale *= dropout.keep_scale
    a, b, base = self.lora_A[name].weight, self.lora_B[name].weight, self.base_layer
    mm_dtype = self._mm_dtype or x.dtype
    if self._base_last:
        # The base matmul after the adapter branch and in a function of its own that saves
        # nothing, so checkpointing's recompute stops before it (see above).
        lora, frozen, h = _LoraLinear.apply(x, a, b, scale, dropped, mm_dtype, None, h)
        out = _FrozenLinear.apply(x, base.weight, base.bias) + lora
    else:
        keeps = record and _keeps_output(self, x)
        out, frozen, h = _LoraLinear.apply(x, a, b, scale, dropped, mm_dtype,
                                           (base.weight, base.bias, kept, keeps), h)
    if record:
        # One record per layer: a second forward with gradients before the first one's
        # backward replaces it (the first one's recompute then draws and multiplies again).
        small = dropped is not None and x.numel() < 2**31
        keep(self, _Kept(fingerprint(x), before,
                         dropped.to(torch.int32) if small else dropped, h,
                         None if dropped is None or before is None else torch.get_rng_state(),
                         frozen))
    return out


def _taken(layer, x):
    """In checkpointing's recompute, what its forward pass kept: (drop positions, rank-r
    activation, frozen output), each None where not kept; the recompute then draws and
    multiplies as usual. Another forward's (recompute.py) is refused. The drops and h are also
    refused when the random state differs from the forward's here (checkpointing replays it:
    unless told not to, when a restore below would rewind the generator). The generator is then
    left where the forward's draw left it, so whatever draws after this layer in the recompute
    (a LoRA layer on peft's path, attention dropout) draws what it drew in the forward pass."""
    kept = take(layer)
    if kept is None or not same(kept.seen, x):
        return None, None, None
    if kept.before is not None and not torch.equal(kept.before, torch.get_rng_state()):
        return None, None, kept.base
    if kept.after is not None:
        torch.set_rng_state(kept.after)
    return (None if kept.dropped is None else kept.dropped.long()), kept.h, kept.base


def _keeps_output(layer, x) -> bool:
    """--selective_checkpointing: whether this forward keeps the layer's frozen matmul output
    for the recompute (its decoder layer's share of the budget)."""
    if layer._keep is None:
        return False
    block, position = layer._keep
    return block.decide(position, x[..., 0].numel())


class _Budget(threading.local):
    """Bytes of frozen outputs one forward may keep (None: no limit). Decoder layers claim their
    share in forward order, until one does not fit; a claim by a layer at or before the last
    one to claim begins a new forward, with the whole budget. Per thread: the parts of a
    --batch_threads step each have an equal share of it."""

    def __init__(self, limit: int | None):
        self.limit, self.left = limit, limit
        self.last = float("inf")  # so the first claim begins a forward too

    def claim(self, index: int, nbytes: int) -> bool:
        if self.limit is None:
            return True
        if index <= self.last:
            self.left = self.limit // share()
        self.last = index
        fits = nbytes <= self.left
        self.left = self.left - nbytes if fits else 0
        return fits


class _BlockKeep(threading.local):
    """One decoder layer's share of a _Budget and this forward's decision, taken by whichever
    of its keeping LoRA layers runs first in a forward (one at or before the last to run); per
    thread, like the budget."""

    def __init__(self, budget: _Budget, index: int, bytes_per_token: int):
        self.budget, self.index, self.bytes_per_token = budget, index, bytes_per_token
        self.keeps, self.last = False, float("inf")  # so the first call decides

    def decide(self, position: int, tokens: int) -> bool:
        if position <= self.last:
            self.keeps = self.budget.claim(self.index, self.bytes_per_token * tokens)
        self.last = position
        return self.keeps


def use_fused_lora(model, bf16_matmuls: bool = False) -> int:
    """Route the training forward of peft's LoRA Linear layers through _LoraLinear; returns how
    many layers. The last one of each checkpointed decoder layer (down_proj) runs its frozen
    matmul after the adapter branch, on its own (see above). `bf16_matmuls`: the adapter's
    products in bf16 on layers with a bf16 base (--bf16_lora_matmuls)."""
    from peft.tuners.lora.layer import Linear
    n = 0
    for module in model.modules():
        if type(module) is Linear and "_peft_forward" not in vars(module):
            module._peft_forward = module.forward
            module.forward = types.MethodType(_fused_forward, module)
            module._keep, module._base_last = None, False
            module._block = None
            module._mm_dtype = (torch.bfloat16 if bf16_matmuls
                                and module.base_layer.weight.dtype == torch.bfloat16 else None)
            n += 1
    for block, fused in _checkpointed_layers(model, blocks=True):
        fused[-1]._base_last = True
        for m in fused:  # a reference, not a submodule: the block is the layer's parent
            object.__setattr__(m, "_block", block)
    return n


def _checkpointed_layers(model, blocks: bool = False):
    """The fused LoRA layers of each checkpointable decoder layer, in registration order, which
    is the forward's (q ... down); with `blocks`, (decoder layer, its fused layers)."""
    from peft.tuners.lora.layer import Linear
    from transformers.modeling_layers import GradientCheckpointingLayer
    for block in model.modules():
        if isinstance(block, GradientCheckpointingLayer):
            fused = [m for m in block.modules() if type(m) is Linear and "_peft_forward" in vars(m)]
            if fused:
                yield (block, fused) if blocks else fused


def keep_frozen_outputs(model, budget: int | None = None) -> int:
    """--selective_checkpointing with fused LoRA layers: each checkpointed decoder layer keeps
    its base outputs from the forward pass for the recompute, except the layer's last one
    (down_proj), which the recompute never reaches. `budget`: bytes those outputs may take in
    one forward (None: no limit); decoder layers keep theirs in forward order while they fit
    (a long batch fewer layers, a short one more), the rest recompute theirs. The numbers are
    the same either way. Returns how many LoRA layers may keep theirs."""
    shared, n = _Budget(budget), 0
    keeping = [fused[:-1] for fused in _checkpointed_layers(model) if len(fused) > 1]
    for index, kept in enumerate(keeping):
        block = _BlockKeep(shared, index, sum(m.base_layer.out_features
                                              * m.base_layer.weight.element_size() for m in kept))
        for position, m in enumerate(kept):
            m._keep = (block, position)
            n += 1
    return n
