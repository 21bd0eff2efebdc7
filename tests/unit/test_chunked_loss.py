"""--chunked_loss: the LM head only at trained positions, in chunks, equals the model's own
loss, including its normalisation per trained token across gradient accumulation."""
from __future__ import annotations


import pytest
import torch


from helpers.marks import BF16_MATH
from helpers.speedups import _assert_close_grads, _grads, _lora_model, _run, _samples


@pytest.mark.parametrize("dtype", ["float32", BF16_MATH])
def test_chunked_loss_equals_model_loss(tiny_qwen2, dtype):
    """supervised_head_loss = the model's own loss, same LoRA gradients, on a packed batch;
    several chunks are forced so the chunk boundaries are exercised."""
    from swiftlite.training.speedups.chunked_loss import supervised_head_loss, why_unsupported
    from swiftlite.training.trainer import collator
    tok, samples = _samples(tiny_qwen2)
    model = _lora_model(tiny_qwen2, dtype)
    assert why_unsupported(model) is None
    batch = collator(tok, True)([dict(s) for s in samples])
    trained = int((batch["labels"][:, 1:] != -100).sum())
    assert trained > 16
    model.zero_grad()
    plain = model(**batch).loss
    plain.backward()
    g_plain = _grads(model)
    model.zero_grad()
    chunked = supervised_head_loss(model, batch, chunk=7)
    chunked.backward()
    tol = 1e-5 if dtype == "float32" else 2e-3
    assert chunked.item() == pytest.approx(plain.item(), rel=tol)
    _assert_close_grads(g_plain, _grads(model), rtol=1e-4 if dtype == "float32" else 3e-2)
    # num_items_in_batch (trained tokens of the whole accumulated batch) sets the denominator
    model.zero_grad()
    scaled = supervised_head_loss(model, batch, num_items_in_batch=torch.tensor(3 * trained))
    assert scaled.item() == pytest.approx(plain.item() / 3, rel=tol)


@pytest.mark.parametrize("dtype", ["float32", BF16_MATH])
def test_chunked_loss_trains_a_tied_head(tiny_qwen2, dtype):
    """Full fine-tuning: the (tied) LM head weight gets the same gradient as the plain path,
    also from bf16 weights (bf16 products accumulated in fp32)."""
    from swiftlite.training.speedups.chunked_loss import supervised_head_loss
    from swiftlite.models.loader import load_model
    from swiftlite.training.trainer import collator
    tok, samples = _samples(tiny_qwen2)
    model = load_model(tiny_qwen2, dtype)
    model.config.use_cache = False
    model.train()
    batch = collator(tok, True)([dict(s) for s in samples])
    model(**batch).loss.backward()
    g_plain = _grads(model)
    model.zero_grad()
    supervised_head_loss(model, batch, chunk=5).backward()
    _assert_close_grads(g_plain, _grads(model), rtol=1e-4 if dtype == "float32" else 3e-2)


@pytest.mark.slow
def test_trainer_loss_per_trained_token_across_accumulation(tmp_path, tiny_qwen2, chat_jsonl):
    """Through the Trainer: batch 4 in one step and batch 2 x 2 accumulation steps see the same
    samples, so with the loss normalised per trained token over the accumulated batch (not a
    mean of micro-batch means) they log the same losses and gradient norms; the chunked loss
    and the model's own loss agree on both, and so do a batch's samples trained in threads
    (--batch_threads, by default on 2 cores or more) and in one."""
    data = chat_jsonl + "#16"
    runs = {(bs, ga, cl, bt): _run(tmp_path, f"b{bs}g{ga}{cl}{bt}", data,
                                   per_device_train_batch_size=bs,
                                   gradient_accumulation_steps=ga, chunked_loss=cl,
                                   batch_threads=bt)
            for bs, ga, cl, bt in [(4, 1, True, 1), (4, 1, True, 2), (2, 2, True, 2),
                                   (2, 2, False, 2)]}
    ref = runs[(4, 1, True, 1)]
    assert len(ref) == 2
    for key, rows in runs.items():
        for a, b in zip(ref, rows):
            assert float(b["loss"]) == pytest.approx(float(a["loss"]), rel=1e-4), key
            assert float(b["grad_norm"]) == pytest.approx(float(a["grad_norm"]), rel=1e-3), key


def test_chunked_loss_flag_off_uses_plain_trainer():
    from transformers import Trainer

    from swiftlite.training.trainer import trainer_class
    assert trainer_class(False).compute_loss is Trainer.compute_loss  # the model's own loss
    assert issubclass(trainer_class(True), Trainer)
    assert trainer_class(True).compute_loss is not Trainer.compute_loss




def test_fp16_head_gradient_matches_fp32_under_the_loss_scale():
    """Under fp16 AMP the loss (per trained token) is backpropagated times GradScaler's scale
    (2**16 at first), and the chunked loss computed its gradient in forward, before the
    scale. The softmax terms of a 152k vocabulary (about 7e-6) are below fp16's normal range;
    the gradient for the hidden states (what LoRA trains through) still matches an fp32
    reference, and nothing overflows: fp16 needs no other path."""
    from swiftlite.training.speedups.chunked_loss import linear_cross_entropy
    torch.manual_seed(0)
    hidden = torch.randn(64, 64).half().requires_grad_()
    weight = (torch.randn(151936, 64) * 0.05).half()
    targets = torch.randint(0, 151936, (64,))
    scale = 2.0 ** 16
    (linear_cross_entropy(hidden, weight, targets) / 64 * scale).backward()
    ref = hidden.detach().float().requires_grad_()
    torch.nn.functional.cross_entropy(ref @ weight.float().t(), targets).backward()
    got = hidden.grad.float() / scale
    assert hidden.grad.dtype == torch.float16 and torch.isfinite(got).all()
    assert (got - ref.grad).norm() / ref.grad.norm() < 1e-3


def test_a_trained_fp32_head_multiplies_in_the_activations_16_bits(monkeypatch):
    """A trained head copy is fp32 (--modules_to_save lm_head); under a GPU's 16-bit autocast
    the hidden states are 16-bit, and the head's products run in those 16 bits, as autocast
    runs the model's own head, not in fp32. A frozen 16-bit head under fp32 activations (the
    CPU default) multiplies in its own 16 bits, and fp32 with fp32 stays fp32. The weight's
    gradient is the fp32 weight's. SFT's chunked loss and the preference losses alike."""
    from swiftlite.training.preference.logps import token_logps
    from swiftlite.training.speedups import chunked_loss, onednn_fp32
    seen = []
    real = onednn_fp32.linear
    monkeypatch.setattr(onednn_fp32, "linear", lambda x, w, *a, **k: seen.append(
        (x.dtype, w.dtype)) or real(x, w, *a, **k))
    real_f = torch.nn.functional.linear
    import swiftlite.training.preference.logps as logps
    monkeypatch.setattr(logps.F, "linear", lambda x, w, *a, **k: seen.append(
        (x.dtype, w.dtype)) or real_f(x, w, *a, **k))
    torch.manual_seed(0)
    for h_dtype, w_dtype, mm in ((torch.bfloat16, torch.float32, torch.bfloat16),
                                 (torch.float32, torch.bfloat16, torch.bfloat16),
                                 (torch.float32, torch.float32, torch.float32)):
        hidden = torch.randn(8, 16, dtype=h_dtype, requires_grad=True)
        weight = torch.randn(32, 16, dtype=w_dtype, requires_grad=True)
        targets = torch.randint(0, 32, (8,))
        for loss in (lambda: chunked_loss.linear_cross_entropy(hidden, weight, targets, 4),
                     lambda: -token_logps(hidden, weight, targets, 4).sum()):
            seen.clear()
            loss().backward()
            assert seen and set(seen) == {(mm, mm)}, (h_dtype, w_dtype, seen)
            assert weight.grad.dtype == w_dtype and hidden.grad.dtype == h_dtype
            weight.grad = hidden.grad = None


def test_the_head_runs_in_the_forwards_autocast_over_fp32_weights(tiny_qwen2):
    """Full fine-tuning in bf16 keeps fp32 master weights and autocasts the forward
    (accelerate wraps the model's forward only); the chunked loss's head runs after it, and
    takes the hidden states in the autocast's dtype, as autocast hands them to the model's own
    head: a bf16 product, not an fp32 one over fp32 hidden states and weights."""
    from swiftlite.models.loader import load_model
    from swiftlite.training.speedups.chunked_loss import decoder_output, matmul_dtype
    from swiftlite.training.trainer import collator
    tok, samples = _samples(tiny_qwen2)
    model = load_model(tiny_qwen2, "float32")
    batch = collator(tok, True)([dict(s) for s in samples])
    batch.pop("labels")
    weight = model.get_output_embeddings().weight
    with torch.autocast("cpu", torch.bfloat16):
        hidden = decoder_output(model, batch)
    assert matmul_dtype(hidden, weight) == torch.bfloat16
    assert matmul_dtype(decoder_output(model, batch), weight) == torch.float32  # no autocast
