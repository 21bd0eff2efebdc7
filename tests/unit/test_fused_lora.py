"""--fused_lora and --selective_checkpointing: LoRA layers as one autograd function equal
peft's, and checkpointing keeps the frozen matmul outputs instead of recomputing them."""
from __future__ import annotations


import pytest
import torch

from swiftlite.config.arguments import SftArguments
from swiftlite.runtime.hardware import cpu_flags
from swiftlite.training.speedups.recompute import kept

from helpers.marks import BF16_CPU_TRAINING, needs_bf16_units
from helpers.speedups import _batch, _assert_close_grads, _grads, _lora_model


class _Matmuls:
    """Counts matmuls that read one of the given tensors (or a view of one)."""

    def __init__(self, tensors):
        from torch.utils._python_dispatch import TorchDispatchMode
        storages = {t.untyped_storage().data_ptr() for t in tensors}

        class Mode(TorchDispatchMode):
            n = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if (func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                             torch.ops.aten.addmm_.default)
                        and any(isinstance(a, torch.Tensor)
                                and a.untyped_storage().data_ptr() in storages for a in args)):
                    self.n += 1
                return func(*args, **(kwargs or {}))
        self.mode = Mode

    def count(self, fn):
        with self.mode() as mode:
            result = fn()
        return result, mode.n


def _FrozenMatmuls(model):
    """Counts matmuls with a frozen weight (a view of a parameter that does not learn)."""
    return _Matmuls(p for p in model.parameters() if not p.requires_grad)


def _loss_grads_matmuls(model, batch, seed=1):
    """(loss, LoRA gradients, frozen matmuls in forward, frozen matmuls in backward)."""
    counter = _FrozenMatmuls(model)
    torch.manual_seed(seed)
    loss, fwd = counter.count(lambda: model(**batch).loss)
    _, bwd = counter.count(loss.backward)
    return loss.item(), _grads(model), fwd, bwd


LAYERS = 2  # tiny-qwen2: 2 decoder layers of 7 frozen linears (+ the LM head, not checkpointed)


@pytest.mark.parametrize("dtype,fused_lora", [
    ("float32", True), ("float32", False),
    *(pytest.param("bfloat16", fused, marks=needs_bf16_units, id=f"bfloat16-{fused}")
      for fused in (True, False))])
def test_selective_checkpointing_equals_plain_without_recomputing_frozen_matmuls(tiny_qwen2,
                                                                                 dtype,
                                                                                 fused_lora):
    """--selective_checkpointing: the same loss and LoRA gradients as plain checkpointing (with
    dropout 0.3, whose masks are replayed), and backward runs only the input-gradient matmuls
    of the frozen weights: none is recomputed. Fused LoRA layers keep their outputs themselves;
    peft's layers (--fused_lora false) go through torch's selective checkpointing."""
    tok, samples, batch = _batch(tiny_qwen2)
    results = {}
    for selective in (False, True):
        model = _lora_model(tiny_qwen2, dtype=dtype, lora_dropout=0.3, fused_lora=fused_lora,
                            selective_checkpointing=selective)
        results[selective] = _loss_grads_matmuls(model, batch)
        # and again: nothing kept from the first step leaks into the second
        results[selective, 2] = _loss_grads_matmuls(model, batch, seed=2)
        # every kept output was handed to the recompute: none outlives the step
        assert all(kept(m) is None for m in model.modules())
    for step in (False, 2):
        key = (lambda selective: selective if step is False else (selective, 2))
        assert results[key(True)][0] == pytest.approx(results[key(False)][0], rel=1e-6)
        _assert_close_grads(results[key(False)][1], results[key(True)][1])
    (_, _, fwd, plain), (_, _, fwd_sel, selective) = results[False], results[True]
    assert fwd == fwd_sel == 7 * LAYERS + 1
    # plain: the input gradients, and every layer matmul recomputed (but down_proj when fused)
    assert plain == fwd + (6 if fused_lora else 7) * LAYERS
    assert selective == fwd  # input gradients only


def _peft_and_fused(model_dir, **lora):
    """{fused_lora: (loss, LoRA gradients, forward matmuls, backward matmuls)} on one batch."""
    batch = _batch(model_dir)[2]
    return {fused: _loss_grads_matmuls(_lora_model(model_dir, fused_lora=fused, **lora), batch)
            for fused in (False, True)}


@pytest.mark.parametrize("dtype", ["float32", BF16_CPU_TRAINING])
def test_fused_lora_equals_peft_and_skips_the_last_recomputed_matmul(tiny_qwen2, dtype):
    """--fused_lora: the same loss and LoRA gradients as peft's modules (dropout 0.3 with the
    same masks, checkpointing on), and checkpointing's recompute stops before each layer's last
    frozen matmul (down_proj), which peft's order (base matmul first) makes it redo."""
    # the adapters' matmuls in fp32, as peft's: bf16 ones have a test of their own
    results = _peft_and_fused(tiny_qwen2, dtype=dtype, lora_dropout=0.3, bf16_lora_matmuls=False)
    (loss, grads, fwd, bwd), (loss_f, grads_f, fwd_f, bwd_f) = results[False], results[True]
    # fp32: rounding only. bf16: a rounding-level change of an fp32 activation can move the
    # bf16 value it is cast to for the next matmul by one unit (0.4%), here and there.
    tolerance = 1e-6 if dtype == "float32" else 1e-5
    assert loss_f == pytest.approx(loss, rel=tolerance)
    _assert_close_grads(grads, grads_f, rtol=1e-4 if dtype == "float32" else 5e-3)
    assert fwd == fwd_f == 7 * LAYERS + 1
    assert bwd == fwd + 7 * LAYERS  # peft: input gradients + all 7 matmuls of a layer again
    assert bwd_f == bwd - LAYERS


def test_fused_lora_gradients_without_checkpointing_or_dropout(tiny_qwen2):
    """The fused branch's own backward (not only through checkpointing's replay), without
    dropout and with it, equals autograd through peft's modules."""
    for dropout in (0.0, 0.3):
        results = _peft_and_fused(tiny_qwen2, gradient_checkpointing=False, lora_dropout=dropout)
        assert results[True][0] == pytest.approx(results[False][0], rel=1e-6)
        _assert_close_grads(results[False][1], results[True][1])


AMX = "amx_bf16" in cpu_flags()


@pytest.mark.skipif(not AMX, reason="AMX-BF16 hosts only")
def test_bf16_lora_matmuls_step_aside_on_amx(tiny_qwen2):
    """On AMX the guarantee below does not hold (measured 2026-12-04 on a Xeon with AMX-BF16:
    final-loss distance 0.0178 vs 0.0040, 4.5x): the plan uses fp32 adapter matmuls there."""
    model = _lora_model(tiny_qwen2, dtype="bfloat16", bf16_lora_matmuls=True)
    assert {m._mm_dtype for m in model.modules() if hasattr(m, "_mm_dtype")} == {None}


@needs_bf16_units
@pytest.mark.skipif(AMX, reason="on AMX the plan steps aside (test above)")
def test_bf16_lora_matmuls_learn_like_fp32_ones(tiny_qwen2):
    """--bf16_lora_matmuls (a bf16 base with fp32 activations): the adapters' products take
    bf16 inputs. With the same dropout drops, the first step's gradients agree with fp32
    adapter matmuls to bf16's rounding of the adapter's own terms; and over 12 AdamW steps the
    per-step and final losses stay as close to an all-fp32 model's as the bf16 base alone
    keeps them (fp32 adapter matmuls on the same bf16 base), within a factor of 2."""
    tok, samples, batch = _batch(tiny_qwen2)
    runs = {}
    for name, dtype, bf16 in (("bf16 matmuls", "bfloat16", True),
                              ("fp32 matmuls", "bfloat16", False), ("fp32 model", "float32", False)):
        model = _lora_model(tiny_qwen2, dtype=dtype, lora_dropout=0.1, bf16_lora_matmuls=bf16)
        dtypes = {m._mm_dtype for m in model.modules() if hasattr(m, "_mm_dtype")}
        assert dtypes == ({torch.bfloat16} if bf16 else {None})
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
        torch.manual_seed(3)
        losses, first_grads = [], None
        for _ in range(12):
            loss = model(**batch).loss
            loss.backward()
            first_grads = first_grads or _grads(model)
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        model.eval()
        with torch.no_grad():
            final = model(**batch).loss.item()
        runs[name] = losses, first_grads, final
    _assert_close_grads(runs["fp32 matmuls"][1], runs["bf16 matmuls"][1], rtol=2e-2)
    ref_losses, _, ref_final = runs["fp32 model"]
    assert ref_losses[0] - ref_final > 0.3, ref_losses  # it learns

    def off(name):  # (largest per-step, final) distance from the all-fp32 run
        losses, _, final = runs[name]
        return max(abs(x - y) for x, y in zip(losses, ref_losses)), abs(final - ref_final)
    (step_bf16, final_bf16), (step_base, final_base) = off("bf16 matmuls"), off("fp32 matmuls")
    assert step_bf16 <= 2 * step_base + 1e-3, runs
    assert final_bf16 <= 2 * final_base + 1e-3, runs


def test_fused_lora_leaves_other_cases_to_peft(tiny_qwen2):
    """Eval mode, merged adapters and torch's own dropout (--fast_dropout false) run peft's
    forward: the fused path is used only where it computes the same thing."""
    from peft.tuners.lora.layer import Linear

    from swiftlite.training.speedups.fused_lora import _plain
    model = _lora_model(tiny_qwen2, lora_dropout=0.1)
    layer = next(m for m in model.modules() if isinstance(m, Linear))
    x = torch.randn(2, 3, layer.in_features)
    assert _plain(layer, x, (), {}) == "default"
    assert _plain(layer, x.bfloat16(), (), {}) is None  # an input the adapter does not match
    model.eval()
    assert _plain(layer, x, (), {}) is None
    model.train()
    torch_dropout = _lora_model(tiny_qwen2, lora_dropout=0.1, fast_dropout=False)
    layer = next(m for m in torch_dropout.modules() if isinstance(m, Linear))
    assert _plain(layer, x, (), {}) is None
    layer.merge()
    assert _plain(layer, x, (), {}) is None


def test_selective_checkpointing_says_full_fine_tuning_has_nothing_to_keep(tiny_qwen2, capsys):
    """Torch's selective policy keeps outputs of matmuls whose weight is frozen; full
    fine-tuning trains every weight, so the policy would only add its per-op dispatch hook.
    prepare_model says so and installs plain checkpointing; LoRA gets the policy."""
    from swiftlite.models.loader import load_model
    from swiftlite.training.tuners import prepare_model
    for train_type, policy in (("full", False), ("lora", True)):
        args = SftArguments(model="x", dataset=["x"], train_type=train_type,
                            selective_checkpointing=True, fused_lora=False)
        model = prepare_model(load_model(tiny_qwen2, "float32"), args)
        layer = next(m for m in model.modules() if hasattr(m, "_gradient_checkpointing_func"))
        assert ("context_fn" in layer._gradient_checkpointing_func.keywords) == policy
        err = capsys.readouterr().err
        assert ("nothing to keep, so plain gradient checkpointing" in err) == (not policy), err


def _budget(model):
    """The memory budget the fused layers of `model` keep their frozen outputs within."""
    return next(m._keep[0].budget for m in model.modules() if getattr(m, "_keep", None))


def _decisions(model):
    """Whether each decoder layer kept its frozen outputs in the last forward, in order."""
    blocks = {m._keep[0].index: m._keep[0] for m in model.modules() if getattr(m, "_keep", None)}
    return [blocks[i].keeps for i in sorted(blocks)]


def _layer_bytes_per_token(model):
    """Bytes one decoder layer keeps per token (its frozen outputs but down_proj's)."""
    return next(m._keep[0].bytes_per_token for m in model.modules() if getattr(m, "_keep", None))


def test_selective_checkpointing_within_a_budget_keeps_the_layers_that_fit(tiny_qwen2):
    """The default on a CPU: decoder layers keep their frozen outputs in forward order while
    they fit in the budget, the others recompute theirs: a budget of one layer at this batch's
    length recomputes one layer's matmuls, a batch twice as long none kept, a shorter one all
    kept; loss and gradients equal plain checkpointing's each time (dropout 0.3, replayed)."""
    _, samples, batch = _batch(tiny_qwen2)
    from swiftlite.training.trainer import collator
    tok = _batch(tiny_qwen2)[0]
    longer = collator(tok, True)([dict(s) for s in samples + samples])
    shorter = collator(tok, True)([dict(samples[0])])
    plain = _lora_model(tiny_qwen2, lora_dropout=0.3, selective_checkpointing=False)
    model = _lora_model(tiny_qwen2, lora_dropout=0.3, selective_checkpointing=True)
    tokens = batch["input_ids"].numel()
    _budget(model).limit = int(1.5 * _layer_bytes_per_token(model) * tokens)
    for b, kept_layers in ((batch, 1), (longer, 0), (shorter, LAYERS), (batch, 1)):
        loss, grads, fwd, bwd = _loss_grads_matmuls(plain, b)
        plain.zero_grad()
        loss_b, grads_b, fwd_b, bwd_b = _loss_grads_matmuls(model, b)
        model.zero_grad()
        assert loss_b == pytest.approx(loss, rel=1e-6)
        _assert_close_grads(grads, grads_b)
        assert fwd == fwd_b == 7 * LAYERS + 1
        assert bwd == fwd + 6 * LAYERS  # plain: every layer's matmuls but down_proj again
        assert bwd_b == bwd - 6 * kept_layers, (b["input_ids"].numel(), kept_layers)
        assert all(kept(m) is None for m in model.modules())
        # in forward order: the first layers keep theirs
        assert _decisions(model) == [i < kept_layers for i in range(LAYERS)]


def test_an_output_kept_in_a_forward_without_backward_never_reaches_a_later_recompute(
        tiny_qwen2):
    """A forward that kept frozen outputs but was never back-propagated (an exception, a
    discarded loss) leaves them behind; a later forward of a layer that does not keep (the
    budget spent) must recompute, not take those: its gradients equal plain checkpointing's."""
    batch = _batch(tiny_qwen2)[2]
    plain = _lora_model(tiny_qwen2, lora_dropout=0.3, selective_checkpointing=False)
    model = _lora_model(tiny_qwen2, lora_dropout=0.3, selective_checkpointing=True)
    _budget(model).limit = None  # every layer keeps
    torch.manual_seed(5)
    model(**batch).loss  # kept, never back-propagated
    _budget(model).limit = 0  # now no layer keeps
    loss, grads, _, _ = _loss_grads_matmuls(plain, batch, seed=2)
    loss_b, grads_b, _, _ = _loss_grads_matmuls(model, batch, seed=2)
    assert loss_b == pytest.approx(loss, rel=1e-6)
    _assert_close_grads(grads, grads_b)


def test_selective_checkpointing_default_budget_and_choices(tiny_qwen2, capsys):
    """Not given: on a CPU with fused LoRA layers over a 16-bit base, a budget of half the
    frozen weights' bytes (at most a tenth of the memory available), said in the log; over an
    fp32 base (twice the memory already), none; true: every layer; false, a GPU or peft's
    layers: none (torch's policy only when asked for)."""
    import psutil

    from swiftlite.models.loader import load_model
    from swiftlite.training import speedups
    base = load_model(tiny_qwen2, "bfloat16")
    weights = sum(p.numel() * p.element_size() for p in base.parameters())
    fp32 = load_model(tiny_qwen2, "float32")
    for model, asked, device, fused, selective, budget in (
            (base, None, "cpu", True, True,
             min(weights // 2, psutil.virtual_memory().available // 10)),
            (fp32, None, "cpu", True, False, None), (fp32, True, "cpu", True, True, None),
            (base, True, "cpu", True, True, None), (base, False, "cpu", True, False, None),
            (base, None, "cuda", True, False, None), (base, None, "cpu", False, False, None),
            (base, "no checkpointing", "cpu", True, False, None)):
        checkpointing = asked != "no checkpointing"
        args = SftArguments(model="x", dataset=["x"], fused_lora=fused,
                            selective_checkpointing=asked if checkpointing else None,
                            gradient_checkpointing=checkpointing)
        p = speedups.plan(model, args, device)
        assert p.selective_checkpointing == selective, (asked, device, fused, model.dtype)
        # the memory available moves a little between the two reads
        assert p.keep_budget == (budget and pytest.approx(budget, rel=0.05)), asked
    _lora_model(tiny_qwen2, dtype="bfloat16", selective_checkpointing=None)
    assert "frozen matmul outputs kept in the layers that fit in" in capsys.readouterr().err


def test_the_budget_starts_again_each_forward_whatever_layers_lora_covers(tiny_qwen2):
    """Targets that give the first decoder layer no LoRA layer that keeps (one adapted linear:
    it is the layer's last, which the recompute never reaches) and the second three: the
    second layer's claim must find the whole budget at every forward, not what the forward
    before left, and its gradients equal plain checkpointing's each time."""
    from swiftlite.models.loader import load_model
    from swiftlite.training.tuners import prepare_model
    batch = _batch(tiny_qwen2)[2]
    targets = [r".*layers\.0\.self_attn\.v_proj|.*layers\.1\.self_attn\.(q|k|v)_proj"]
    models = {}
    for asked in (False, True):
        torch.manual_seed(0)
        args = SftArguments(model="x", dataset=["x"], lora_dropout=0.3, target_modules=targets,
                            selective_checkpointing=asked)
        model = prepare_model(load_model(tiny_qwen2, "float32"), args)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
        model.train()
        models[asked] = model
    model = models[True]
    assert _decisions(model) == [False]  # one decoder layer keeps: q and k of layer 1
    per_forward = _layer_bytes_per_token(model) * batch["input_ids"].numel()
    budget = _budget(model)
    budget.limit = budget.left = int(1.5 * per_forward)  # room for it once a forward
    for seed in (1, 2, 3):
        loss, grads, _, _ = _loss_grads_matmuls(models[False], batch, seed=seed)
        models[False].zero_grad()
        loss_b, grads_b, _, _ = _loss_grads_matmuls(model, batch, seed=seed)
        model.zero_grad()
        assert loss_b == pytest.approx(loss, rel=1e-6)
        _assert_close_grads(grads, grads_b)
        assert _decisions(model) == [True], seed


def test_the_recompute_replays_the_forward_drops_and_adapter_products(tiny_qwen2, monkeypatch):
    """Under checkpointing each fused LoRA layer keeps its drop positions and its rank-r
    activation from the forward pass: the recompute draws no dropout positions and multiplies
    no lora_A again (its only product in backward is the input gradient's), whether it keeps
    its frozen outputs or not; loss and gradients equal peft's with the same masks. A forward
    with gradients that is never back-propagated leaves nothing a later one's recompute takes."""
    from swiftlite.training.speedups import fast_dropout
    draws = {"n": 0}
    real = fast_dropout.drop_positions

    def counted(*args, **kwargs):
        draws["n"] += 1
        return real(*args, **kwargs)
    monkeypatch.setattr(fast_dropout, "drop_positions", counted)
    _, samples, batch = _batch(tiny_qwen2)
    from swiftlite.training.trainer import collator
    other = collator(_batch(tiny_qwen2)[0], True)([dict(s) for s in samples[:1]])
    peft = _lora_model(tiny_qwen2, lora_dropout=0.3, fused_lora=False)
    for selective in ("no checkpointing", False, True):
        model = _lora_model(tiny_qwen2, lora_dropout=0.3, selective_checkpointing=selective is True,
                            gradient_checkpointing=selective != "no checkpointing")
        adapters = _Matmuls(m.lora_A["default"].weight for m in model.modules()
                            if hasattr(m, "_peft_forward"))
        torch.manual_seed(5)
        model(**other).loss  # a forward with gradients, never back-propagated
        for seed in (1, 2):
            draws["n"] = 0
            torch.manual_seed(seed)
            loss, products = adapters.count(lambda: model(**batch).loss)
            assert (draws["n"], products) == (7 * LAYERS, 7 * LAYERS)
            draws["n"] = 0
            _, products = adapters.count(loss.backward)
            # lora_A's only product in backward is each layer's input gradient (under
            # checkpointing peft has the embeddings' output require grad: the first layer's too)
            inputs = 7 * LAYERS - (3 if selective == "no checkpointing" else 0)
            assert (draws["n"], products) == (0, inputs), selective
            loss_p, grads_p, _, _ = _loss_grads_matmuls(peft, batch, seed=seed)
            assert loss.item() == pytest.approx(loss_p, rel=1e-6)
            _assert_close_grads(grads_p, _grads(model))
            model.zero_grad()
            peft.zero_grad()



def test_what_draws_after_a_replayed_layer_draws_what_it_drew_in_the_forward(tiny_qwen2):
    """A LoRA layer on peft's path (here: a forward hook on its base layer) draws its dropout
    mask in the recompute too; the fused layers before it in the decoder layer do not draw
    there, so they must leave the random generator as their forward draws did, or its mask
    (and every gradient through it) would differ. Loss and gradients equal peft's throughout."""
    batch = _batch(tiny_qwen2)[2]
    peft = _lora_model(tiny_qwen2, lora_dropout=0.3, fused_lora=False)
    mixed = _lora_model(tiny_qwen2, lora_dropout=0.3)
    hooked = [m for name, m in mixed.named_modules()
              if name.endswith("mlp.up_proj") and hasattr(m, "_peft_forward")]
    for m in hooked:
        m.base_layer.register_forward_hook(lambda *args: None)
    from swiftlite.training.speedups.fused_lora import _plain
    x = torch.randn(1, 2, hooked[0].in_features)
    assert _plain(hooked[0], x, (), {}) is None  # peft's path, after q, k, v, o and gate
    for seed in (1, 2):
        loss, grads, _, _ = _loss_grads_matmuls(peft, batch, seed=seed)
        loss_m, grads_m, _, _ = _loss_grads_matmuls(mixed, batch, seed=seed)
        assert loss_m == pytest.approx(loss, rel=1e-6)
        _assert_close_grads(grads, grads_m)
        peft.zero_grad()
        mixed.zero_grad()


@pytest.mark.parametrize("selective", [False, True])
def test_a_recompute_takes_only_what_its_own_forward_kept(tiny_qwen2, selective):
    """Two forwards with gradients of batches of the same shape, then the first one's backward:
    its recompute must not take what the second kept (drop positions, adapter activations,
    attention outputs, frozen outputs: another batch's), and the second's backward after it
    must still be right. Both equal peft's one forward + backward."""
    batch = _batch(tiny_qwen2)[2]
    peft = _lora_model(tiny_qwen2, lora_dropout=0.3, fused_lora=False)
    expected = {}
    for seed in (1, 2):
        expected[seed] = _loss_grads_matmuls(peft, batch, seed=seed)[:2]
        peft.zero_grad()
    model = _lora_model(tiny_qwen2, lora_dropout=0.3, selective_checkpointing=selective)
    losses = {}
    for seed in (1, 2):
        torch.manual_seed(seed)
        losses[seed] = model(**batch).loss
    for seed in (1, 2):
        losses[seed].backward()
        assert losses[seed].item() == pytest.approx(expected[seed][0], rel=1e-6)
        _assert_close_grads(expected[seed][1], _grads(model))
        model.zero_grad()


def test_a_forward_without_checkpointing_keeps_nothing_for_a_recompute(tiny_qwen2):
    """Gradient checkpointing turned off after the speed-ups were installed (selective, every
    layer keeping): no recompute will come, so a forward with gradients keeps nothing (no frozen
    output, no drop positions, no attention output) and still equals peft's."""
    batch = _batch(tiny_qwen2)[2]
    peft = _lora_model(tiny_qwen2, lora_dropout=0.3, fused_lora=False)
    model = _lora_model(tiny_qwen2, lora_dropout=0.3, selective_checkpointing=True)
    model.gradient_checkpointing_disable()
    torch.manual_seed(1)
    loss = model(**batch).loss
    assert [name for name, m in model.named_modules()
            if kept(m) is not None] == []
    loss.backward()
    loss_p, grads_p, _, _ = _loss_grads_matmuls(peft, batch, seed=1)
    assert loss.item() == pytest.approx(loss_p, rel=1e-6)
    _assert_close_grads(grads_p, _grads(model))
