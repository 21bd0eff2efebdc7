"""LoRA dropout with a cheaper random mask (`--fast_dropout`, on by default).

peft's LoRA dropout is `nn.Dropout`. On a CPU, torch draws its mask with `bernoulli_`: one
32-bit Mersenne-Twister draw and a float comparison per element, about 70x the cost of the
multiplication it feeds. A LoRA model draws one mask per adapted layer input (7 per decoder
layer with all-linear targets), twice when gradient checkpointing recomputes the layer: on
SmolLM2-135M that was 22% of a training step (torch profiler, 900 tokens, fp32).

Here each 64-bit draw from the same torch generator gives the random bits of eight elements
(8 bits each), and an element is dropped when its byte is below round(p * 256). That rounds
the drop rate to a multiple of 1/256 (0.05 -> 13/256 = 0.0508); when rounding would move it by
more than 2% of p (p = 0.01, say), 16 bits per element are drawn instead (four per draw, the
rate exact to 1/65536). The kept values are scaled by the exact inverse of the keep rate, so
the output is unbiased like nn.Dropout's. Because the bits come from torch's default
generator, a seeded run is reproducible and checkpointing's RNG-state replay recomputes the
same mask. The backward pass keeps a 1-byte mask instead of a float one.

The masks differ from nn.Dropout's (another use of the random stream), so a run with it
matches one without it in distribution, not bit for bit; with p = 0 both are the identity.
"""
from __future__ import annotations

import math

import torch

RATE_TOLERANCE = 0.02  # relative change of p that 8-bit masks may make


def mask_bits(p: float) -> tuple[int, int]:
    """(bits per element, threshold): an element is dropped when its bits are < threshold."""
    for bits in (8, 16):
        threshold = round(p * (1 << bits))
        if abs(threshold / (1 << bits) - p) <= RATE_TOLERANCE * p:
            break
    return bits, threshold


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


def drop_mask(shape, bits: int, threshold: int) -> torch.Tensor:
    """A bool mask (True = drop) with P(True) = threshold / 2**bits."""
    n = math.prod(shape)
    per_word = 64 // bits
    words = torch.empty((n + per_word - 1) // per_word, dtype=torch.int64)
    words.random_(-2**63, 2**63 - 1)  # every bit uniform
    if bits == 8:
        return words.view(torch.uint8)[:n].view(shape) < threshold
    # int16 is signed: values run from -32768, so shift the threshold by as much
    return words.view(torch.int16)[:n].view(shape) < threshold - (1 << 15)


class FastDropout(torch.nn.Module):
    """Drop-in for nn.Dropout(p) on CPU tensors; other devices use torch's own dropout."""

    def __init__(self, p: float):
        super().__init__()
        if not 0 <= p < 1:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.bits, self.threshold = mask_bits(p)
        self.rate = self.threshold / (1 << self.bits)  # the drop rate the masks really have
        self.keep_scale = 1 / (1 - self.rate)  # what kept values are multiplied by

    def mask(self, shape) -> torch.Tensor | None:
        """The drop mask of a training forward over `shape` (None: nothing to drop)."""
        if not self.training or self.threshold == 0:
            return None
        return drop_mask(shape, self.bits, self.threshold)

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        if x.device.type != "cpu":  # GPU bernoulli is cheap (Philox); keep the stock kernel
            return torch.nn.functional.dropout(x, self.p, True)
        drop = self.mask(x.shape)
        return x if drop is None else _DropScale.apply(x, drop, self.keep_scale)

    def extra_repr(self) -> str:
        return f"p={self.p}, drawn as {self.threshold}/{1 << self.bits} = {self.rate:.4g}"


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
