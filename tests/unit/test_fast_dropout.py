"""--fast_dropout: LoRA dropout drawn as the positions it drops is dropout, replayed by
checkpointing, and learns like torch's."""
from __future__ import annotations


import pytest
import torch


from helpers.marks import BF16_CPU_TRAINING
from helpers.speedups import _batch, _assert_close_grads, _grads, _lora_model, _samples


def test_fast_dropout_is_dropout():
    """Drop rate p exactly, kept values scaled to keep the mean, the gradient masked and scaled
    the same way; identity at p = 0 and in eval mode; reproducible from torch's seed."""
    from swiftlite.training.speedups.fast_dropout import FastDropout
    x = torch.randn(300, 1000, requires_grad=True)
    drop = FastDropout(0.1).train()
    torch.manual_seed(0)
    y = drop(x)
    dropped = y == 0
    # 300,000 elements: the binomial's standard deviation is 0.00055
    assert dropped.float().mean().item() == pytest.approx(0.1, abs=0.002)
    torch.testing.assert_close(y[~dropped], x[~dropped] / 0.9)
    y.sum().backward()
    torch.testing.assert_close(x.grad, (~dropped).float() / 0.9)
    torch.manual_seed(0)
    assert torch.equal(drop(x), y)  # same seed, same drops
    g = torch.randn(1000, 300)
    x.grad = None
    torch.manual_seed(0)
    drop(x).backward(g.t())  # a transposed gradient: the positions count in row-major order
    torch.testing.assert_close(x.grad, torch.where(dropped, 0.0, g.t() / 0.9))
    ones = torch.ones(2000, 2000)
    assert drop(ones).mean().item() == pytest.approx(1.0, abs=0.003)  # unbiased
    small = FastDropout(0.01).train()(ones)
    assert (small == 0).float().mean().item() == pytest.approx(0.01, abs=0.0005)
    assert small.mean().item() == pytest.approx(1.0, abs=0.003)
    assert drop.eval()(x) is x and FastDropout(0.0).train()(x) is x


def test_drop_positions_are_independent_drops_at_rate_p():
    """The geometric gaps give what n independent coin flips would: each position (the first
    and the last included) dropped with probability p, a drop not making its neighbour more or
    less likely, and the same positions when the first draw runs short and more are drawn."""
    from swiftlite.training.speedups.fast_dropout import drop_positions
    torch.manual_seed(0)
    n, p, trials = 64, 0.05, 20_000
    hits = torch.zeros(n)
    pairs = 0
    for _ in range(trials):
        pos = drop_positions(n, p)
        assert bool((pos[1:] > pos[:-1]).all()) and (len(pos) == 0 or 0 <= pos[0] <= pos[-1] < n)
        hits[pos] += 1
        pairs += int((pos[1:] - pos[:-1] == 1).sum())
    rate = hits / trials  # per position: standard deviation 0.0015
    assert rate.sub(p).abs().max().item() < 0.0075, rate
    assert rate[0].item() == pytest.approx(p, abs=0.0075)
    assert rate[-1].item() == pytest.approx(p, abs=0.0075)
    # adjacent drops: (n - 1) p^2 per trial if independent (sd of the count about 2%)
    assert pairs / trials == pytest.approx((n - 1) * p * p, rel=0.1)
    torch.manual_seed(1)
    one_draw = drop_positions(10_000, 0.3)
    torch.manual_seed(1)
    short_draws = drop_positions(10_000, 0.3, draws=7)  # about 430 rounds of 7 gaps
    assert torch.equal(one_draw, short_draws) and len(short_draws) > 2_800
    assert len(drop_positions(0, p)) == 0


@pytest.mark.parametrize("dtype", ["float32", BF16_CPU_TRAINING])
def test_fast_dropout_masks_are_replayed_by_checkpointing(tiny_qwen2, dtype):
    """Checkpointing recomputes each layer in backward: the recomputed dropout masks must be the
    ones of the forward pass, or the LoRA gradients would be wrong. Same loss and gradients
    with and without checkpointing, with dropout 0.3 on every adapter."""
    from swiftlite.training.speedups.fast_dropout import FastDropout
    from swiftlite.training.trainer import collator
    tok, samples = _samples(tiny_qwen2)
    results = []
    for checkpointing in (False, True):
        model = _lora_model(tiny_qwen2, dtype=dtype, gradient_checkpointing=checkpointing,
                            lora_dropout=0.3)
        assert any(isinstance(m, FastDropout) for m in model.modules())
        batch = collator(tok, True)([dict(s) for s in samples])
        torch.manual_seed(1)
        loss = model(**batch).loss
        loss.backward()
        results.append((loss.item(), _grads(model)))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6)
    _assert_close_grads(results[0][1], results[1][1])


@pytest.mark.slow
def test_fast_dropout_learns_like_torch_dropout(tiny_qwen2):
    """Different masks, same learning: 12 steps of AdamW (lr 1e-2) at dropout 0.1 on the same batch land
    on the same loss (within dropout's own noise) with FastDropout and with nn.Dropout."""
    tok, samples, batch = _batch(tiny_qwen2)
    final = {}
    for fast in (True, False):
        model = _lora_model(tiny_qwen2, lora_dropout=0.1, fast_dropout=fast)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        torch.manual_seed(3)
        for _ in range(12):
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        with torch.no_grad():
            final[fast] = model(**batch).loss.item()
    first = _lora_model(tiny_qwen2).eval()(**batch).loss.item()
    learned = first - final[False]  # about 0.45 on this random tiny model
    assert learned > 0.2 and first - final[True] > 0.2, (first, final)
    assert abs(final[True] - final[False]) < 0.15 * learned, (first, final)


