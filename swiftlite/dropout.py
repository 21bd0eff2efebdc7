"""LoRA dropout with a cheaper random mask (`--fast_dropout`, on by default).

peft's LoRA dropout is `nn.Dropout`. On a CPU, torch draws its mask with `bernoulli_`: one
32-bit Mersenne-Twister draw and a float comparison per element, about 70x the cost of the
multiplication it feeds. A LoRA model draws one mask per adapted layer input (7 per decoder
layer with all-linear targets), twice when gradient checkpointing recomputes the layer: on
SmolLM2-135M that was 22% of a training step (torch profiler, 900 tokens, fp32).

Here one 64-bit draw from the same torch generator gives the random bits of four elements
(16 each), and an element is dropped when its bits fall below round(p * 65536). The drop
rate is p to within 1 / 131072 and the kept values are scaled by the exact inverse of the
keep rate, so the output is unbiased like nn.Dropout's. Because the bits come from torch's
default generator, a seeded run is reproducible and checkpointing's RNG-state replay
recomputes the same mask. The backward pass keeps a 1-byte mask instead of a float one.

The masks differ from nn.Dropout's (another use of the random stream), so a run with it
matches one without it in distribution, not bit for bit; with p = 0 both are the identity.
"""
from __future__ import annotations

import torch

BITS = 16
LEVELS = 1 << BITS


class _DropScale(torch.autograd.Function):
    """x * scale where drop is False, 0 where it is True (gradient likewise)."""

    @staticmethod
    def forward(ctx, x, drop, scale):
        ctx.save_for_backward(drop)
        ctx.scale = scale
        return torch.where(drop, 0.0, x * scale)

    @staticmethod
    def backward(ctx, grad):
        (drop,) = ctx.saved_tensors
        return torch.where(drop, 0.0, grad * ctx.scale), None, None


def drop_mask(shape, p: float) -> tuple[torch.Tensor, float]:
    """A bool mask (True = drop) with P(True) ~= p, and the scale for the kept elements."""
    threshold = round(p * LEVELS)  # elements whose 16 bits are below this are dropped
    n = 1
    for d in shape:
        n *= d
    words = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-2**63, 2**63 - 1)
    bits = words.view(torch.int16)[:n].view(shape)  # each uniform on [-32768, 32767]
    return bits < threshold - LEVELS // 2, LEVELS / (LEVELS - threshold)


class FastDropout(torch.nn.Module):
    """Drop-in for nn.Dropout(p) on CPU tensors; other devices use torch's own dropout."""

    def __init__(self, p: float):
        super().__init__()
        if not 0 <= p < 1:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        if x.device.type != "cpu":  # GPU bernoulli is cheap (Philox); keep the stock kernel
            return torch.nn.functional.dropout(x, self.p, True)
        drop, scale = drop_mask(x.shape, self.p)
        return _DropScale.apply(x, drop, scale)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def use_fast_dropout(model) -> int:
    """Replace the nn.Dropout modules in peft's `lora_dropout` dicts; returns how many."""
    n = 0
    for module in model.modules():
        dropouts = getattr(module, "lora_dropout", None)
        if isinstance(dropouts, torch.nn.ModuleDict):
            for name, drop in dropouts.items():
                if type(drop) is torch.nn.Dropout and drop.p > 0:
                    dropouts[name] = FastDropout(drop.p)
                    n += 1
    return n
