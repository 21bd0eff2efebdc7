"""--fast_dropout: LoRA dropout masks from 8 random bits per element are dropout, replayed by checkpointing, and learn like torch's."""
from __future__ import annotations


import pytest
import torch


from speedup_helpers import _assert_close_grads, _grads, _lora_model, _samples


def test_fast_dropout_is_dropout():
    """Drop rate p, kept values scaled to keep the mean, the gradient masked and scaled the same
    way; identity at p = 0 and in eval mode; reproducible from torch's seed."""
    from swiftlite.training.speedups.fast_dropout import FastDropout
    x = torch.randn(300, 1000, requires_grad=True)
    drop = FastDropout(0.1).train()
    assert (drop.bits, drop.rate) == (8, 26 / 256)  # 0.1016: within 2% of p
    assert FastDropout(0.01).rate == round(0.01 * 65536) / 65536  # 8 bits would be 17% off
    torch.manual_seed(0)
    y = drop(x)
    dropped = y == 0
    assert dropped.float().mean().item() == pytest.approx(26 / 256, abs=0.002)
    scale = 1 / (1 - 26 / 256)
    torch.testing.assert_close(y[~dropped], x[~dropped] * scale)
    y.sum().backward()
    torch.testing.assert_close(x.grad, (~dropped).float() * scale)
    torch.manual_seed(0)
    assert torch.equal(drop(x), y)  # same seed, same mask
    ones = torch.ones(2000, 2000)
    assert drop(ones).mean().item() == pytest.approx(1.0, abs=0.003)  # unbiased
    small = FastDropout(0.01).train()(ones)  # the 16-bit path
    assert (small == 0).float().mean().item() == pytest.approx(0.01, abs=0.0005)
    assert small.mean().item() == pytest.approx(1.0, abs=0.003)
    assert drop.eval()(x) is x and FastDropout(0.0).train()(x) is x


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
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


def test_fast_dropout_learns_like_torch_dropout(tiny_qwen2):
    """Different masks, same learning: 12 steps of AdamW (lr 1e-2) at dropout 0.1 on the same batch land
    on the same loss (within dropout's own noise) with FastDropout and with nn.Dropout."""
    from swiftlite.training.trainer import collator
    tok, samples = _samples(tiny_qwen2)
    batch = collator(tok, True)([dict(s) for s in samples])
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


