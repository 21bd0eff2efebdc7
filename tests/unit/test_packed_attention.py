"""--padding_free: packed batches with per-sample SDPA learn what right-padded batches learn."""
from __future__ import annotations

import pytest

from swiftlite.training.speedups.recompute import kept

from helpers.marks import BF16_CPU_TRAINING
from helpers.speedups import _step, _batch, _assert_close_grads, _grads, _lora_model, _samples


@pytest.mark.parametrize("gradient_checkpointing", [True, False])
def test_padding_free_equals_padded(tiny_qwen2, gradient_checkpointing):
    """Same loss and LoRA gradients from a padded batch (stock SDPA), from a packed row with
    stock SDPA (one block-diagonal mask), and from a packed row with SDPA per sample
    (sdpa_packed, what sft uses); with and without checkpointing (the KV cache must be off)."""
    from swiftlite.training.speedups.packed_attention import use_packed_attention
    from swiftlite.training.trainer import collator
    tok, samples = _samples(tiny_qwen2)
    model = _lora_model(tiny_qwen2, gradient_checkpointing=gradient_checkpointing,
                        attn_impl="sdpa")
    assert model.config._attn_implementation == "sdpa"
    results = []
    for padding_free, packed_attention in ((False, False), (True, False), (True, True)):
        if packed_attention:
            assert use_packed_attention(model)
        batch = collator(tok, padding_free)([dict(s) for s in samples])
        if padding_free:
            assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
        else:
            assert batch["input_ids"].shape[0] == len(samples)
        model.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        results.append((loss.item(), _grads(model)))
    padded, g_padded = results[0]
    for loss, grads in results[1:]:
        assert loss == pytest.approx(padded, rel=1e-5)
        _assert_close_grads(g_padded, grads)


def test_sft_trains_with_packed_attention_unless_told(tiny_qwen2):
    from swiftlite.training.speedups.packed_attention import NAME
    assert _lora_model(tiny_qwen2).config._attn_implementation == NAME
    assert _lora_model(tiny_qwen2, attn_impl="sdpa").config._attn_implementation == "sdpa"




def test_sample_boundaries_are_read_once_per_forward(tiny_qwen2, monkeypatch):
    """Every layer, and its recompute under checkpointing, gets the same position_ids: the
    boundaries (a host sync on a GPU) are read once per forward and backward, not per layer."""
    from swiftlite.training.speedups import packed_attention as pa
    from swiftlite.training.trainer import collator
    real, calls = pa._segments, []
    monkeypatch.setattr(pa, "_segments", lambda pos: calls.append(1) or real(pos))
    tok, samples = _samples(tiny_qwen2)
    model = _lora_model(tiny_qwen2, gradient_checkpointing=True)
    assert model.config._attn_implementation == pa.NAME
    assert model.config.num_hidden_layers > 1
    model(**collator(tok, True)([dict(s) for s in samples])).loss.backward()
    assert len(calls) == 1


@pytest.mark.parametrize("device, dtype, capability, expected", [
    ("cpu", "float32", None, True), ("cpu", "bfloat16", None, True),
    ("cuda", "bfloat16", (8, 0), True), ("cuda", "float16", (9, 0), True),
    ("cuda", "float16", (7, 5), False),  # T4: no flash kernel; math kernel if asked for GQA
    ("cuda", "float32", (8, 6), False),  # no fp32 flash kernel
    ("npu", "bfloat16", None, False),
])
def test_gqa_is_left_to_sdpa_only_where_its_kernel_takes_it(device, dtype, capability,
                                                           expected):
    import torch
    from swiftlite.training.speedups.packed_attention import gqa_in_kernel
    assert gqa_in_kernel(device, getattr(torch, dtype), capability) == expected


@pytest.mark.parametrize("dtype", ["float32", BF16_CPU_TRAINING])
def test_kept_attention_equals_recomputed_and_runs_the_kernel_once_fewer(tiny_qwen2, dtype,
                                                                        monkeypatch):
    """--keep_attention: with checkpointing, the attention output kept from the forward pass is
    what the recompute would have computed, bit for bit: the same loss and LoRA gradients (two
    steps, LoRA dropout 0.3 replayed), with the forward kernel run once per sample and layer
    instead of twice, and nothing left kept after backward."""
    import torch

    from swiftlite.training.speedups import keep_attention as ka
    tok, samples, batch = _batch(tiny_qwen2)
    calls = []
    monkeypatch.setattr(ka, "_FORWARD", lambda *a, **k: calls.append(1) or
                        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*a, **k))
    results = {}
    for keep in (False, True):
        model = _lora_model(tiny_qwen2, dtype=dtype, lora_dropout=0.3, keep_attention=keep)
        attention = [m for m in model.modules() if hasattr(m, "_keep_attention")]
        assert len(attention) == (model.config.num_hidden_layers if keep else 0)
        for step in (1, 2):
            results[keep, step] = _step(model, batch, calls, step)
            assert all(kept(m) is None for m in attention)
    layers, n = model.config.num_hidden_layers, len(samples)
    for step in (1, 2):
        (loss, grads, off_calls), (loss_k, grads_k, on_calls) = results[False, step], \
            results[True, step]
        assert loss_k == loss
        _assert_close_grads(grads, grads_k, rtol=0)
        assert off_calls == 0 and on_calls == layers * n  # off: stock SDPA, twice per layer


def test_attention_is_kept_only_where_a_recompute_uses_it(tiny_qwen2):
    """Not without checkpointing (nothing is recomputed), nor when told not to."""
    for kw in ({"gradient_checkpointing": False}, {"keep_attention": False}):
        model = _lora_model(tiny_qwen2, **kw)
        assert not any(hasattr(m, "_keep_attention") for m in model.modules()), kw
