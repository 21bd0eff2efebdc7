"""--onednn_fp32: an fp32 base's matmuls through oneDNN where it is faster than torch's BLAS on
this CPU, with the same loss and gradients."""
from __future__ import annotations

import pytest
import torch

from helpers.speedups import _step, _assert_close_grads, _lora_model, _samples
from swiftlite.training.speedups import onednn_fp32


def test_onednn_fp32_learns_like_blas_and_runs_the_frozen_products(tiny_qwen2, monkeypatch):
    """The same loss and LoRA gradients (fp32: only the order of the sums differs) over two
    steps with dropout, with the frozen layers' products and the LM head's through oneDNN when
    the measurement says it is faster (forced here: the CPU running this may not be such a
    CPU; test_onednn_fp32_follows_the_measured_rates covers the decision)."""
    from swiftlite.training.trainer import collator
    calls = []
    real = onednn_fp32._onednn
    monkeypatch.setattr(onednn_fp32, "_onednn", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(onednn_fp32, "faster", lambda: True)
    tok, samples = _samples(tiny_qwen2)
    batch = collator(tok, True)([dict(s) for s in samples])
    results = {}
    for on in (False, True):
        model = _lora_model(tiny_qwen2, lora_dropout=0.3, onednn_fp32=on)
        marked = [p for p in model.parameters() if onednn_fp32.marked(p)]
        assert len(marked) == (7 * model.config.num_hidden_layers + 1 if on else 0)  # + head
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for step in (1, 2):
            results[on, step] = _step(model, batch, calls, step)
            opt.step()
    for step in (1, 2):
        (loss, grads, n_off), (loss_on, grads_on, n_on) = results[False, step], results[True, step]
        assert loss_on == pytest.approx(loss, rel=1e-6)
        _assert_close_grads(grads, grads_on, rtol=1e-4)
        assert n_off == 0 and n_on > 0


def test_onednn_fp32_follows_the_measured_rates(monkeypatch):
    """Decided by this CPU's measured rates (1.2x or more), said with them; a bf16 model's
    matmuls are oneDNN's anyway, so nothing is measured or marked for it."""
    from swiftlite.config.arguments import SftArguments
    from swiftlite.training import speedups
    monkeypatch.setattr(onednn_fp32, "_RATES", {"blas": 190.0, "onednn": 430.0})
    assert onednn_fp32.faster()
    assert "oneDNN (measured here: BLAS 190.0 GFLOP/s, oneDNN 430.0" in onednn_fp32.describe()
    monkeypatch.setattr(onednn_fp32, "_RATES", {"blas": 300.0, "onednn": 330.0})
    assert not onednn_fp32.faster()
    assert onednn_fp32.describe().startswith("fp32 matmuls: torch's BLAS")
    linear = torch.nn.Linear(4, 4).requires_grad_(False)
    assert onednn_fp32.use_onednn_fp32(linear) == 0
    args = SftArguments(model="x", dataset=["x"])
    assert speedups.plan(linear, args, "cpu").onednn_fp32
    assert not speedups.plan(linear.to(torch.bfloat16), args, "cpu").onednn_fp32
    assert not speedups.plan(linear.float(), args, "cuda").onednn_fp32


def test_rates_are_measured_here_without_touching_the_training_randomness(monkeypatch):
    """Both kernels run on this CPU and give positive GFLOP/s; the measurement draws its
    matrices from a generator of its own, so a seeded run initialises the same with it."""
    monkeypatch.setattr(onednn_fp32, "_RATES", {})
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    r = dict(onednn_fp32.rates())
    assert torch.equal(torch.rand(3), expected)
    assert r["blas"] > 1 and r["onednn"] > 1
