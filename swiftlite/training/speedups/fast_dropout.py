"""LoRA dropout drawn as the positions it drops (`--fast_dropout`, on by default).

peft's LoRA dropout is `nn.Dropout`. On a CPU, torch draws its mask with `bernoulli_`: one
32-bit Mersenne-Twister draw and a float comparison per element, then a pass that multiplies by
the mask, and backward multiplies the gradient by it again. A LoRA model draws one mask per
adapted layer input (7 per decoder layer with all-linear targets), twice when gradient
checkpointing recomputes the layer: on SmolLM2-135M that was 22% of a training step (torch
profiler, 900 tokens, fp32).

LoRA dropout rates are small (0.05 is the usual one), so most of that work is spent on elements
that are kept. Here only the dropped elements are drawn: the gaps between them in the flattened
input are geometric (the number of kept elements before the next drop, `floor(log(1 - u) /
log(1 - p))` for a uniform u), so about p * n draws give the sorted flat positions of the drops,
exactly the distribution of n independent drops with rate p. The forward pass scales (or, in
fused_lora.py, copies) the input and zeroes those positions; backward zeroes them in the
gradient; the positions (8 bytes each, about 0.4 byte per element at p = 0.05) are what is
kept for backward instead of a mask.

The draws come from torch's default generator (in float64, so the longest gap is not cut off
at float32's resolution), so a seeded run is reproducible and checkpointing's RNG-state replay
recomputes the same drops; with --batch_threads, from the generator of the thread's part of
the batch (batch_threads.py). They use the random stream differently from nn.Dropout, so a run
with it matches one without it in distribution, not bit for bit; at p = 0 both are the
identity. The cost grows with p: at high rates (p >= 0.5, say) torch's kernel is cheaper.
"""
from __future__ import annotations

import math

import torch

from swiftlite.training.speedups.batch_threads import generator


def drop_positions(n: int, p: float, draws: int | None = None) -> torch.Tensor:
    """Sorted int64 positions in range(n), each dropped independently with probability p.

    `draws`: how many gaps to draw first (default: enough for all but about one call in 10^9;
    more are drawn while the positions have not passed n)."""
    if n == 0:
        return torch.empty(0, dtype=torch.int64)
    mean = n * p
    if draws is None:
        draws = min(n, math.ceil(mean + 6 * math.sqrt(mean * (1 - p)) + 16))
    log_keep = math.log1p(-p)
    parts, end = [], -1  # end: the last position drawn so far
    while end < n:
        u = torch.rand(draws, dtype=torch.float64, generator=generator())
        # floor(log(1 - u) / log(1 - p)) kept elements before each drop, then the drop itself
        steps = torch.log1p(-u).div_(log_keep).floor_().to(torch.int64).add_(1)
        part = torch.cumsum(steps, 0).add_(end)
        parts.append(part)
        end = int(part[-1])
    positions = parts[0] if len(parts) == 1 else torch.cat(parts)
    return positions[:int(torch.searchsorted(positions, n))]


class _DropScale(torch.autograd.Function):
    """x * scale with the dropped positions zeroed (the gradient likewise)."""

    @staticmethod
    def forward(ctx, x, positions, scale):
        ctx.save_for_backward(positions)
        ctx.scale = scale
        out = x * scale
        out.view(-1).index_fill_(0, positions, 0.0)
        return out

    @staticmethod
    def backward(ctx, grad):
        (positions,) = ctx.saved_tensors
        grad = grad.contiguous() * ctx.scale  # row-major, as the positions count
        grad.view(-1).index_fill_(0, positions, 0.0)
        return grad, None, None


class FastDropout(torch.nn.Module):
    """Drop-in for nn.Dropout(p) on CPU tensors; other devices use torch's own dropout."""

    def __init__(self, p: float):
        super().__init__()
        if not 0 <= p < 1:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.keep_scale = 1 / (1 - p)  # what kept values are multiplied by

    def positions(self, shape) -> torch.Tensor | None:
        """The flat positions a training forward over `shape` drops (None: nothing to drop)."""
        if not self.training or self.p == 0:
            return None
        return drop_positions(math.prod(shape), self.p)

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        if x.device.type != "cpu":  # GPU bernoulli is cheap (Philox); keep the stock kernel
            return torch.nn.functional.dropout(x, self.p, True)
        return _DropScale.apply(x.contiguous(), self.positions(x.shape), self.keep_scale)

    def extra_repr(self) -> str:
        return f"p={self.p}, drawn as drop positions"


def use_fast_dropout(model) -> list[FastDropout]:
    """Replace the nn.Dropout modules in peft's `lora_dropout` dicts; returns the new ones."""
    new = []
    for module in model.modules():
        dropouts = getattr(module, "lora_dropout", None)
        if isinstance(dropouts, torch.nn.ModuleDict):
            for name, drop in dropouts.items():
                if type(drop) is torch.nn.Dropout and drop.p > 0:
                    dropouts[name] = FastDropout(drop.p)
                    new.append(dropouts[name])
    return new
