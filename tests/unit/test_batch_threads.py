"""--batch_threads: a batch's samples trained in threads give the whole batch's step."""
from __future__ import annotations

import threading

import pytest
import torch

from swiftlite.config.arguments import SftArguments
from swiftlite.training.speedups import batch_threads
from swiftlite.training.speedups.chunked_loss import supervised_head_loss
from swiftlite.training.speedups.recompute import kept

from helpers.speedups import _assert_close_grads, _batch, _grads, _lora_model


def _row(lengths):
    """A padding-free row of samples of these lengths (token i of sample j is 100 * j + i)."""
    ids = torch.cat([torch.arange(n) + 100 * j for j, n in enumerate(lengths)])[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}


def _samples_of(part):
    starts = (part["position_ids"][0] == 0).nonzero().flatten().tolist()
    return [int(part["input_ids"][0, s]) // 100 for s in starts]


def test_a_padding_free_row_is_cut_at_sample_starts_into_parts_of_about_equal_tokens():
    batch = _row([450, 120, 229, 300])
    parts = batch_threads.split(batch, 2)
    assert [_samples_of(p) for p in parts] == [[0, 1], [2, 3]]  # 570 and 529 tokens
    for p in parts:  # whole samples, every key cut alike, in the batch's order
        assert p["input_ids"].shape == p["labels"].shape == p["position_ids"].shape
        assert torch.equal(p["input_ids"], p["labels"])
    together = torch.cat([p["input_ids"] for p in parts], dim=1)
    assert sorted(together[0].tolist()) == sorted(batch["input_ids"][0].tolist())
    assert [_samples_of(p) for p in batch_threads.split(_row([5, 9, 7]), 4)] == [[1], [2], [0]]


def test_padded_rows_are_split_by_row_and_what_cannot_be_split_is_left_whole():
    ids = torch.arange(12).view(3, 4)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    parts = batch_threads.split({"input_ids": ids, "attention_mask": mask}, 2)
    assert [p["input_ids"].tolist() for p in parts] == [[[0, 1, 2, 3]], [[4, 5, 6, 7],
                                                                         [8, 9, 10, 11]]]
    assert batch_threads.split(_row([17]), 2) is None  # one sample
    no_positions = {"input_ids": torch.zeros(1, 8, dtype=torch.long)}
    assert batch_threads.split(no_positions, 2) is None
    other = {**_row([3, 4]), "pixel_values": torch.zeros(2, 3, 4, 4)}
    assert batch_threads.split(other, 2) is None  # a key this does not know how to cut


def test_an_error_in_any_part_is_raised_once_every_part_is_done():
    finished = []

    def step(part):
        if part == "bad":
            raise ValueError("part 1 failed")
        finished.append((part, threading.current_thread().name))
        return part

    cores = torch.get_num_threads()
    with pytest.raises(ValueError, match="part 1 failed"):
        batch_threads.run(step, ["good", "bad", "also good"])
    assert sorted(p for p, _ in finished) == ["also good", "good"]
    assert torch.get_num_threads() == cores  # the process's cores back, error or not
    assert batch_threads.run(step, ["a", "b"]) == ["a", "b"]
    assert torch.get_num_threads() == cores and batch_threads.generator() is None


def _threaded_step(model, batch, seed, n=2, first=None):
    """The Trainer's threaded step: each part's loss over the whole batch's trained tokens.
    Returns (loss, gradients, whether every part's forward kept something for its recompute
    and its recompute took all of it). first: the thread ("main" or "pool") whose part runs
    whole before the other's starts."""
    num_items = int((batch["labels"][:, 1:] != -100).sum())
    model.zero_grad()
    done = threading.Event()

    def part(p):
        mine = "main" if threading.current_thread() is threading.main_thread() else "pool"
        if first is not None and mine != first:
            assert done.wait(timeout=60)
        loss = supervised_head_loss(model, p, num_items)  # the Trainer's (chunked) loss
        recorded = any(kept(m) is not None for m in model.modules())
        loss.backward()
        done.set()
        return loss.detach(), recorded and all(kept(m) is None for m in model.modules())

    torch.manual_seed(seed)
    results = batch_threads.run(part, batch_threads.split(batch, n))
    return sum(r[0] for r in results).item(), _grads(model), all(r[1] for r in results)


@pytest.mark.parametrize("selective", [False, True])
def test_the_threaded_step_is_the_whole_batch_step(tiny_qwen2, selective):
    """No dropout: the parts' summed loss and gradients equal one forward and backward of the
    whole batch (checkpointing with kept frozen outputs and attention, per thread)."""
    batch = _batch(tiny_qwen2)[2]
    model = _lora_model(tiny_qwen2, selective_checkpointing=selective)
    loss = model(**batch).loss
    loss.backward()
    whole = _grads(model)
    # Both parts' decoders end together: each part's loss must still read its own hidden states
    meet = threading.Barrier(2, timeout=60)

    def together(*_):
        meet.wait()
    model.get_decoder().register_forward_hook(together)
    threaded, grads, all_taken = _threaded_step(model, batch, seed=0)
    assert threaded == pytest.approx(loss.item(), rel=1e-5)
    _assert_close_grads(whole, grads)
    assert all_taken


def test_threaded_dropout_is_seeded_and_each_recompute_takes_its_own_forwards_drops(tiny_qwen2):
    """LoRA dropout drawn per part from a generator seeded when the step begins: the same seed
    gives the same step whichever thread runs first, and a checkpointed step equals one without
    checkpointing (the recompute reused the forward's drop positions, drew nothing)."""
    batch = _batch(tiny_qwen2)[2]
    model = _lora_model(tiny_qwen2, lora_dropout=0.3, selective_checkpointing=True)
    loss_1, grads_1, taken = _threaded_step(model, batch, seed=3, first="main")
    loss_2, grads_2, _ = _threaded_step(model, batch, seed=3, first="pool")
    assert taken and loss_1 == loss_2
    _assert_close_grads(grads_1, grads_2, rtol=0)
    plain = _lora_model(tiny_qwen2, lora_dropout=0.3, gradient_checkpointing=False)
    loss_p, grads_p, _ = _threaded_step(plain, batch, seed=3, first="pool")
    assert loss_p == pytest.approx(loss_1, rel=1e-6)
    _assert_close_grads(grads_p, grads_1)
    loss_4, _, _ = _threaded_step(model, batch, seed=4)
    assert loss_4 != loss_1  # another seed, other drops


def test_a_threaded_trainer_step_decides_the_chunked_loss_once(tiny_qwen2, tmp_path,
                                                               monkeypatch, capsys):
    """The chunked loss is decided (and a fallback warned about) once, before the parts'
    threads start: decided in each part's thread, a slow decision would be made, and warned
    about, once per part. The model's own loss, threaded, is the whole batch's."""
    import time

    from transformers import TrainingArguments

    from swiftlite.training.speedups import chunked_loss
    from swiftlite.training.trainer import trainer_class

    def slow_reason(model):
        time.sleep(0.5)  # both parts would be inside the decision at once
        return "this test says so"
    monkeypatch.setattr(chunked_loss, "why_unsupported", slow_reason)
    model = _lora_model(tiny_qwen2)
    batch = _batch(tiny_qwen2)[2]
    whole = model(**batch).loss.item()
    trainer = trainer_class(True)(model=model, args=TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True))
    trainer.batch_threads = 2
    capsys.readouterr()
    num_items = torch.tensor(int((batch["labels"][:, 1:] != -100).sum()))
    loss = trainer.training_step(model, batch, num_items)
    assert capsys.readouterr().err.count("this test says so") == 1
    assert loss.item() == pytest.approx(whole, rel=1e-5)


def _args(**kw):
    return SftArguments(model="x", dataset=["x"], per_device_train_batch_size=4, **kw)


def test_threads_are_used_only_where_the_step_stays_the_same(tiny_qwen2, monkeypatch, capsys):
    model = _lora_model(tiny_qwen2, lora_dropout=0.1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    # an fp32 base: one thread unless asked (its step kept both cores busy already)
    assert batch_threads.threads(model, _args(lora_dropout=0.1), "cpu") == 1
    assert batch_threads.threads(model, _args(lora_dropout=0.1, batch_threads=2), "cpu") == 2
    assert batch_threads.threads(model, _args(batch_threads=3), "cpu") == 3
    assert batch_threads.threads(model, _args(batch_threads=1), "cpu") == 1
    one_sample = SftArguments(model="x", dataset=["x"], per_device_train_batch_size=1)
    assert batch_threads.threads(model, one_sample, "cpu") == 1
    assert batch_threads.threads(model, _args(), "cuda") == 1
    bf16_fp32_act = _lora_model(tiny_qwen2, dtype="bfloat16", lora_dropout=0.1)
    assert batch_threads.threads(bf16_fp32_act, _args(), "cpu") == 2  # the default
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert batch_threads.threads(bf16_fp32_act, _args(), "cpu") == 1  # one core: nothing to share
    assert batch_threads.threads(model, _args(batch_threads=2), "cpu") == 2  # asked for
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    peft_layers = _lora_model(tiny_qwen2, fused_lora=False)
    capsys.readouterr()
    assert batch_threads.threads(peft_layers, _args(batch_threads=2), "cpu") == 1
    assert "--batch_threads 2: one thread, because it needs every LoRA layer on " \
           "--fused_lora's path" in capsys.readouterr().err
    model.config.attention_dropout = 0.1
    assert batch_threads.threads(model, _args(batch_threads=2), "cpu") == 1
    model.config.attention_dropout = 0.0
    assert batch_threads.threads(model, _args(batch_threads=2, neftune_noise_alpha=5.0),
                                 "cpu") == 1
    # nn.Dropout on peft's path (--fast_dropout false) draws from torch's default generator
    model.config.output_router_logits = True  # a mixture of experts' auxiliary loss
    assert batch_threads.threads(model, _args(batch_threads=2), "cpu") == 1
    model.config.output_router_logits = False
    plain_dropout = _lora_model(tiny_qwen2, lora_dropout=0.1, fast_dropout=False)
    assert batch_threads.threads(plain_dropout, _args(batch_threads=2, lora_dropout=0.0),
                                 "cpu") == 1
    # 16-bit activations over fp32 adapters: every LoRA layer takes peft's path
    bf16 = _lora_model(tiny_qwen2, dtype="bfloat16", fp32_activations=False, lora_dropout=0.1)
    assert batch_threads.threads(bf16, _args(batch_threads=2, fp32_activations=False),
                                 "cpu") == 1
    assert batch_threads.threads(bf16_fp32_act, _args(batch_threads=2), "cpu") == 2


def test_packed_attention_keeps_each_threads_batch_boundaries_apart(monkeypatch):
    """Each part's layers read its own samples' boundaries, computed once per part: a cache
    shared between threads could hand one part the other's (between its check and its read)
    and made every layer of both parts compute them again."""
    from swiftlite.training.speedups import packed_attention
    computed = []
    real = packed_attention._segments
    monkeypatch.setattr(packed_attention, "_segments",
                        lambda row: computed.append(len(row)) or real(row))
    a, b = _row([3, 4])["position_ids"], _row([2, 2, 5])["position_ids"]
    seen = {}

    def layers(name, pos, meet):
        for _ in range(3):
            seen.setdefault(name, []).append(packed_attention._row_segments(pos))
            meet.wait()

    meet = threading.Barrier(2, timeout=60)
    threads = [threading.Thread(target=layers, args=(n, p, meet)) for n, p in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["a"] == [[[(0, 3), (3, 7)]]] * 3
    assert seen["b"] == [[[(0, 2), (2, 4), (4, 9)]]] * 3
    assert sorted(computed) == [7, 9]  # once per part
