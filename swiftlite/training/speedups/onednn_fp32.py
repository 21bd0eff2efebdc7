"""fp32 matmuls through oneDNN where it beats torch's BLAS on this CPU (`--onednn_fp32`, CPU).

torch multiplies fp32 matrices with the BLAS it was built with (MKL in the PyPI wheels), and
bf16 ones with oneDNN. On an AMD EPYC with AVX-512, MKL ran its AVX2 code: SmolLM2's layer
products in fp32 at less than half the rate of oneDNN's AVX-512 kernels (figures in
docs/performance.md); on a CPU whose BLAS uses all of it the two are close. So which one runs
is measured once per process on a layer-sized product, not guessed
from the vendor, and said in the run log. Both are fp32 throughout (oneDNN's fp32 math mode
is left at its default, with no bf16 or tf32 rounding); only the order of the sums differs.

Used by the fused LoRA layers for their frozen matmuls and by the chunked loss for the LM head,
the products that make up most of an fp32 step.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

MARK = "_onednn_fp32"  # set on the frozen fp32 weights whose products go through oneDNN
_RATES: dict = {}  # measured once per process: a fact of this CPU


def _rate(fn, x, w, repeats: int = 3) -> float:
    fn(x, w)  # the first call builds the kernel
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn(x, w)
        best = min(best, time.perf_counter() - t)
    return 2 * x.shape[0] * x.shape[1] * w.shape[0] / best / 1e9


def _onednn(x, w, bias=None):
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


def rates() -> dict:
    """GFLOP/s of torch's fp32 BLAS and of oneDNN on a layer-sized product here (about 0.1 s,
    once per process)."""
    if not _RATES:
        g = torch.Generator().manual_seed(0)  # not the global one: a seeded run stays the same
        x, w = torch.randn(512, 576, generator=g), torch.randn(1536, 576, generator=g)
        _RATES.update(blas=round(_rate(F.linear, x, w), 1), onednn=round(_rate(_onednn, x, w), 1))
    return _RATES


def faster() -> bool:
    """Whether oneDNN multiplies fp32 at least 1.2x as fast as torch's BLAS on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    r = rates()
    return r["onednn"] >= 1.2 * r["blas"]


def describe() -> str:
    r, which = rates(), "oneDNN" if faster() else "torch's BLAS"
    return (f"fp32 matmuls: {which} (measured here: BLAS {r['blas']} GFLOP/s, oneDNN "
            f"{r['onednn']} GFLOP/s)")


def use_onednn_fp32(model) -> int:
    """Mark `model`'s frozen fp32 matrices (the fused LoRA layers' base weights, the LM head)
    for oneDNN if it is faster here; returns how many."""
    if not faster():
        return 0
    n = 0
    for p in model.parameters():
        if p.dtype == torch.float32 and p.dim() == 2 and not p.requires_grad:
            setattr(p, MARK, True)
            n += 1
    return n


def marked(w: torch.Tensor) -> bool:
    return getattr(w, MARK, False)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           onednn: bool | None = None) -> torch.Tensor:
    """x @ w^T (+ bias); by oneDNN if `onednn` (default: whether w is marked) and both are fp32
    on a CPU. `w` may be a transposed view (see mm)."""
    if onednn is None:
        onednn = marked(w)
    if onednn and x.dtype == w.dtype == torch.float32 and x.device.type == "cpu":
        return _onednn(x, w, bias)
    return F.linear(x, w, bias)


def mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w (an input gradient through a weight w), by oneDNN if w is marked."""
    return linear(x, w.t(), onednn=marked(w))
