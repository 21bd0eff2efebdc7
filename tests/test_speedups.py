"""Each training speed-up learns exactly what the plain computation learns.

- padding-free batches (--padding_free) vs right-padded batches;
- the LM head only at trained positions, chunked (--chunked_loss) vs the model's own loss,
  including its normalisation per trained token across gradient accumulation;
- CPU mixed precision (--torch_dtype bfloat16: frozen base in bf16, LoRA + optimizer in fp32);
- cheaper LoRA dropout masks (--fast_dropout) and tcmalloc (lower peak memory);
- LoRA layers as one autograd function (--fused_lora) and selective checkpointing.
All on the real tiny Qwen2 (151,936-token vocabulary) and its real tokenizer.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from swiftlite.arguments import SftArguments


def _lora_model(model_dir, dtype="float32", gradient_checkpointing=True, seed=0, attn_impl=None,
                fp32_activations=True, lora_dropout=0.0, fast_dropout=True,
                selective_checkpointing=False, fused_lora=True):
    from swiftlite.models.loader import load_model
    from swiftlite.tuners import prepare_model
    torch.manual_seed(seed)
    args = SftArguments(model="x", dataset=["x"], lora_dropout=lora_dropout, attn_impl=attn_impl,
                        fast_dropout=fast_dropout, selective_checkpointing=selective_checkpointing,
                        fused_lora=fused_lora,
                        gradient_checkpointing=gradient_checkpointing,
                        fp32_activations=fp32_activations)
    model = prepare_model(load_model(model_dir, dtype), args)
    for name, p in model.named_parameters():  # lora_B starts at 0: give the adapters a say
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    model.train()
    return model


def _samples(model_dir):
    from swiftlite.models.loader import load_tokenizer
    from swiftlite.template import get_template
    tok = load_tokenizer(model_dir)
    tpl = get_template("qwen", tok)
    convs = [[{"role": "user", "content": "What is 2+2?"},
              {"role": "assistant", "content": "2+2 is 4, as everyone knows."}],
             [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "Capital of France?"},
              {"role": "assistant", "content": "Paris."},
              {"role": "user", "content": "And of Italy? Tell me more about it, please."},
              {"role": "assistant", "content": "Rome, the capital since 1871."}],
             [{"role": "user", "content": "Name three colours."},
              {"role": "assistant", "content": "Red, green and blue."}]]
    return tok, [tpl.encode(c) for c in convs]


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _assert_close_grads(a, b, rtol=1e-4):
    assert a.keys() == b.keys() and a
    for n in a:
        scale = a[n].abs().max().item()
        assert scale > 0, f"{n} got no gradient"
        assert (a[n] - b[n]).abs().max().item() <= rtol * scale + 1e-12, n


@pytest.mark.parametrize("gradient_checkpointing", [True, False])
def test_padding_free_equals_padded(tiny_qwen2, gradient_checkpointing):
    """Same loss and LoRA gradients from a padded batch (stock SDPA), from a packed row with
    stock SDPA (one block-diagonal mask), and from a packed row with SDPA per sample
    (sdpa_packed, what sft uses); with and without checkpointing (the KV cache must be off)."""
    from swiftlite.packed_attention import use_packed_attention
    from swiftlite.trainer import collator
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
    from swiftlite.packed_attention import NAME
    assert _lora_model(tiny_qwen2).config._attn_implementation == NAME
    assert _lora_model(tiny_qwen2, attn_impl="sdpa").config._attn_implementation == "sdpa"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunked_loss_equals_model_loss(tiny_qwen2, dtype):
    """supervised_head_loss = the model's own loss, same LoRA gradients, on a packed batch;
    several chunks are forced so the chunk boundaries are exercised."""
    from swiftlite.loss import supervised_head_loss, why_unsupported
    from swiftlite.trainer import collator
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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunked_loss_trains_a_tied_head(tiny_qwen2, dtype):
    """Full fine-tuning: the (tied) LM head weight gets the same gradient as the plain path,
    also from bf16 weights (bf16 products accumulated in fp32)."""
    from swiftlite.loss import supervised_head_loss
    from swiftlite.models.loader import load_model
    from swiftlite.trainer import collator
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


def _run(tmp_path, name, data, **kw):
    import swiftlite
    res = swiftlite.sft(model="tiny-qwen2", dataset=[data], max_steps=2, logging_steps=1,
                        learning_rate=1e-2, lora_dropout=0.0, warmup_ratio=0.0,
                        save_strategy="no", report_to="none", output_dir=str(tmp_path / name),
                        **{"torch_dtype": "float32", **kw})  # exact sums; bf16 rounds per batch
    return [json.loads(line) for line in open(os.path.join(res.output_dir, "logging.jsonl"))
            if '"loss"' in line]


def test_trainer_loss_per_trained_token_across_accumulation(tmp_path, tiny_qwen2, chat_jsonl):
    """Through the Trainer: batch 4 in one step and batch 2 x 2 accumulation steps see the same
    samples, so with the loss normalised per trained token over the accumulated batch (not a
    mean of micro-batch means) they log the same losses and gradient norms; the chunked loss
    and the model's own loss agree on both."""
    data = chat_jsonl + "#16"
    runs = {(bs, ga, cl): _run(tmp_path, f"b{bs}g{ga}{cl}", data, per_device_train_batch_size=bs,
                               gradient_accumulation_steps=ga, chunked_loss=cl)
            for bs, ga, cl in [(4, 1, True), (2, 2, True), (2, 2, False)]}
    ref = runs[(4, 1, True)]
    assert len(ref) == 2
    for key, rows in runs.items():
        for a, b in zip(ref, rows):
            assert float(b["loss"]) == pytest.approx(float(a["loss"]), rel=1e-4), key
            assert float(b["grad_norm"]) == pytest.approx(float(a["grad_norm"]), rel=1e-3), key


def test_cpu_mixed_precision_keeps_trainables_fp32(tiny_qwen2):
    """--torch_dtype bfloat16 on CPU: frozen base weights bf16, LoRA weights fp32 (so AdamW's
    state is fp32 too), activations fp32 (--fp32_activations, default) so the LoRA sums are not
    rounded to bf16; the loss then matches fp32 more closely than with all-bf16 activations."""
    from swiftlite.loss import supervised_head_loss
    from swiftlite.trainer import collator
    tok, samples = _samples(tiny_qwen2)
    batch = collator(tok, True)([dict(s) for s in samples])
    losses = {}
    for dtype, fp32_act in (("float32", True), ("bfloat16", True), ("bfloat16", False)):
        model = _lora_model(tiny_qwen2, dtype, fp32_activations=fp32_act)
        trainable = [p for p in model.parameters() if p.requires_grad]
        frozen = [p for p in model.parameters() if not p.requires_grad]
        assert {p.dtype for p in trainable} == {torch.float32}
        assert {p.dtype for p in frozen} == {getattr(torch, dtype)}
        seen = []
        hook = model.get_base_model().model.layers[0].register_forward_hook(
            lambda _m, _i, out: seen.append(out[0] if isinstance(out, tuple) else out))
        losses[dtype, fp32_act] = model(**batch).loss.item()
        hook.remove()
        assert seen[0].dtype == (torch.float32 if fp32_act else torch.bfloat16)
        assert supervised_head_loss(model, batch).item() == pytest.approx(
            losses[dtype, fp32_act], rel=1e-3)
        if dtype == "bfloat16":
            opt = torch.optim.AdamW(trainable, lr=1e-3)
            model(**batch).loss.backward()
            opt.step()
            assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())
    ref = losses["float32", True]
    assert abs(losses["bfloat16", True] - ref) < abs(losses["bfloat16", False] - ref)
    assert losses["bfloat16", True] == pytest.approx(ref, rel=1e-3)


def test_chunked_loss_flag_off_uses_plain_trainer():
    from transformers import Trainer

    from swiftlite.trainer import trainer_class
    assert trainer_class(False) is Trainer
    assert issubclass(trainer_class(True), Trainer) and trainer_class(True) is not Trainer


def test_sft_help_is_instant():
    """`swiftlite sft --help` imports neither torch nor transformers."""
    code = ("import sys, swiftlite.cli as c\n"
            "try:\n    c.main(['sft', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))")
    t = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "--chunked_loss" in out.stdout and "--padding_free" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert time.time() - t < 5  # < 1 s on an idle machine; loose here, CI shares the cores


def test_commands_run_under_tcmalloc_when_installed(tiny_qwen2, chat_jsonl, tmp_path):
    """`swiftlite sft` re-executes itself with tcmalloc preloaded when the system has it (CI
    installs libtcmalloc-minimal4) and says so; SWIFTLITE_ALLOCATOR=glibc keeps glibc."""
    from conftest import run_cli
    from swiftlite.allocator import find_tcmalloc
    if find_tcmalloc() is None:
        pytest.skip("tcmalloc is not installed here (apt-get install libtcmalloc-minimal4)")
    flags = ["sft", "--model", tiny_qwen2, "--dataset", chat_jsonl, "--template", "qwen",
             "--max_steps", "1", "--per_device_train_batch_size", "2", "--report_to", "none",
             "--save_strategy", "no"]
    r = run_cli(*flags, "--output_dir", tmp_path / "a", env={"SWIFTLITE_ALLOCATOR": ""})
    assert "memory allocator: tcmalloc" in r.stderr
    r = run_cli(*flags, "--output_dir", tmp_path / "b", env={"SWIFTLITE_ALLOCATOR": "glibc"})
    assert "memory allocator: glibc (SWIFTLITE_ALLOCATOR=glibc)" in r.stderr


def test_allocator_line_says_what_runs_and_what_to_do(monkeypatch):
    from swiftlite import allocator
    monkeypatch.delenv("SWIFTLITE_ALLOCATOR", raising=False)
    monkeypatch.setattr(allocator, "active", lambda: "glibc")
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    assert "apt-get install libtcmalloc-minimal4" in allocator.describe()
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: "/usr/lib/libtcmalloc_minimal.so.4")
    assert "LD_PRELOAD=/usr/lib/libtcmalloc_minimal.so.4" in allocator.describe()  # Python API
    monkeypatch.setenv("SWIFTLITE_ALLOCATOR", "glibc")
    assert allocator.describe() == "memory allocator: glibc (SWIFTLITE_ALLOCATOR=glibc)"
    monkeypatch.setattr(allocator, "active", lambda: "tcmalloc")
    assert allocator.describe().startswith("memory allocator: tcmalloc")


def test_main_called_from_python_never_reexecutes(monkeypatch, tmp_path, capsys):
    """Only the `swiftlite` process itself re-executes under tcmalloc: cli.main(argv) called from
    Python (a notebook, a test runner) must not replace its caller's process."""
    from swiftlite import cli

    def no_exec(*a):
        raise AssertionError("os.execve called from cli.main(argv)")
    monkeypatch.setattr(os, "execve", no_exec)
    monkeypatch.delenv("SWIFTLITE_ALLOCATOR", raising=False)
    assert cli.main(["merge-lora", "--ckpt_dir", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err


def test_tcmalloc_halves_peak_memory_of_checkpointed_training(smollm2, tmp_path):
    """Why swiftlite preloads tcmalloc: three checkpointed LoRA steps of SmolLM2-135M (1,400,
    600 and 1,000 tokens) leave glibc's heap full of holes it cannot return, tcmalloc reuses
    them. Measured here: peak RSS 2,261 MB under glibc vs 1,203 MB under tcmalloc (a whole
    30-step run: 3,152 vs 1,383 MB). The peak is VmHWM: ru_maxrss would start from pytest's own
    size, which Linux carries over into the child."""
    from swiftlite.allocator import find_tcmalloc
    lib = find_tcmalloc()
    if lib is None:
        pytest.skip("tcmalloc is not installed here (apt-get install libtcmalloc-minimal4)")
    script = tmp_path / "peak.py"
    script.write_text(
        "import sys, torch\n"
        "from swiftlite.arguments import SftArguments\n"
        "from swiftlite.memory import peak_rss_bytes\n"
        "from swiftlite.loss import supervised_head_loss\n"
        "from swiftlite.models.loader import load_model\n"
        "from swiftlite.tuners import prepare_model\n"
        "torch.manual_seed(0)\n"
        "m = prepare_model(load_model(sys.argv[1], 'float32'), SftArguments(model='x', dataset=['x']))\n"
        "m.train()\n"
        "for T in (1400, 600, 1000):\n"
        "    ids = torch.randint(0, 49000, (1, T)); labels = ids.clone(); labels[:, :T // 4] = -100\n"
        "    pos = torch.cat([torch.arange(T // 4)] * 4)[None]\n"
        "    supervised_head_loss(m, dict(input_ids=ids, labels=labels, position_ids=pos)).backward()\n"
        "print(peak_rss_bytes() // 2**20)\n")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    peak = {}
    for name, extra in (("glibc", {}), ("tcmalloc", {"LD_PRELOAD": lib})):
        out = subprocess.run([sys.executable, str(script), smollm2], env={**env, **extra},
                             capture_output=True, text=True, check=True)
        peak[name] = int(out.stdout.split()[-1])
    assert peak["tcmalloc"] < 0.7 * peak["glibc"], peak


def test_fast_dropout_is_dropout():
    """Drop rate p, kept values scaled to keep the mean, the gradient masked and scaled the same
    way; identity at p = 0 and in eval mode; reproducible from torch's seed."""
    from swiftlite.dropout import FastDropout
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
    from swiftlite.dropout import FastDropout
    from swiftlite.trainer import collator
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
    from swiftlite.trainer import collator
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


class _FrozenMatmuls:
    """Counts matmuls with a frozen weight (a view of a parameter that does not learn)."""

    def __init__(self, model):
        from torch.utils._python_dispatch import TorchDispatchMode
        frozen = {p.untyped_storage().data_ptr() for p in model.parameters()
                  if not p.requires_grad}

        class Mode(TorchDispatchMode):
            n = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if (func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
                        and any(isinstance(a, torch.Tensor)
                                and a.untyped_storage().data_ptr() in frozen for a in args)):
                    self.n += 1
                return func(*args, **(kwargs or {}))
        self.mode = Mode

    def count(self, fn):
        with self.mode() as mode:
            result = fn()
        return result, mode.n


def _loss_grads_matmuls(model, batch, seed=1):
    """(loss, LoRA gradients, frozen matmuls in forward, frozen matmuls in backward)."""
    counter = _FrozenMatmuls(model)
    torch.manual_seed(seed)
    loss, fwd = counter.count(lambda: model(**batch).loss)
    _, bwd = counter.count(loss.backward)
    return loss.item(), _grads(model), fwd, bwd


LAYERS = 2  # tiny-qwen2: 2 decoder layers of 7 frozen linears (+ the LM head, not checkpointed)


@pytest.mark.parametrize("dtype,fused_lora", [("float32", True), ("bfloat16", True),
                                               ("float32", False), ("bfloat16", False)])
def test_selective_checkpointing_equals_plain_without_recomputing_frozen_matmuls(tiny_qwen2,
                                                                                 dtype,
                                                                                 fused_lora):
    """--selective_checkpointing: the same loss and LoRA gradients as plain checkpointing (with
    dropout 0.3, whose masks are replayed), and backward runs only the input-gradient matmuls
    of the frozen weights: none is recomputed. Fused LoRA layers keep their outputs themselves;
    peft's layers (--fused_lora false) go through torch's selective checkpointing."""
    from swiftlite.trainer import collator
    tok, samples = _samples(tiny_qwen2)
    batch = collator(tok, True)([dict(s) for s in samples])
    results = {}
    for selective in (False, True):
        model = _lora_model(tiny_qwen2, dtype=dtype, lora_dropout=0.3, fused_lora=fused_lora,
                            selective_checkpointing=selective)
        results[selective] = _loss_grads_matmuls(model, batch)
        # and again: nothing kept from the first step leaks into the second
        results[selective, 2] = _loss_grads_matmuls(model, batch, seed=2)
        # every kept output was handed to the recompute: none outlives the step
        assert all(getattr(m, "_kept", None) is None for m in model.modules())
    for step in (False, 2):
        key = (lambda selective: selective if step is False else (selective, 2))
        assert results[key(True)][0] == pytest.approx(results[key(False)][0], rel=1e-6)
        _assert_close_grads(results[key(False)][1], results[key(True)][1])
    (_, _, fwd, plain), (_, _, fwd_sel, selective) = results[False], results[True]
    assert fwd == fwd_sel == 7 * LAYERS + 1
    # plain: the input gradients, and every layer matmul recomputed (but down_proj when fused)
    assert plain == fwd + (6 if fused_lora else 7) * LAYERS
    assert selective == fwd  # input gradients only


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_lora_equals_peft_and_skips_the_last_recomputed_matmul(tiny_qwen2, dtype):
    """--fused_lora: the same loss and LoRA gradients as peft's modules (dropout 0.3 with the
    same masks, checkpointing on), and checkpointing's recompute stops before each layer's last
    frozen matmul (down_proj), which peft's order (base matmul first) makes it redo."""
    from swiftlite.trainer import collator
    tok, samples = _samples(tiny_qwen2)
    batch = collator(tok, True)([dict(s) for s in samples])
    results = {}
    for fused in (False, True):
        model = _lora_model(tiny_qwen2, dtype=dtype, lora_dropout=0.3, fused_lora=fused)
        results[fused] = _loss_grads_matmuls(model, batch)
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
    from swiftlite.trainer import collator
    tok, samples = _samples(tiny_qwen2)
    batch = collator(tok, True)([dict(s) for s in samples])
    for dropout in (0.0, 0.3):
        results = []
        for fused in (False, True):
            model = _lora_model(tiny_qwen2, gradient_checkpointing=False, lora_dropout=dropout,
                                fused_lora=fused)
            results.append(_loss_grads_matmuls(model, batch))
        assert results[1][0] == pytest.approx(results[0][0], rel=1e-6)
        _assert_close_grads(results[0][1], results[1][1])


def test_fused_lora_leaves_other_cases_to_peft(tiny_qwen2):
    """Eval mode, merged adapters and torch's own dropout (--fast_dropout false) run peft's
    forward: the fused path is used only where it computes the same thing."""
    from peft.tuners.lora.layer import Linear

    from swiftlite.fused_lora import _plain
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


def test_gpu_runs_keep_peft_layers_and_torch_precision(tiny_qwen2):
    """sft loads the model on the CPU and the Trainer moves it to the GPU later, so prepare_model
    is told the training device: for a GPU neither fused LoRA layers nor the CPU's
    fp32-activation patch, and --selective_checkpointing goes through torch's policy. (No GPU
    here: only the device name is passed; nothing runs on it.)"""
    from peft.tuners.lora.layer import Linear
    from transformers.modeling_layers import GradientCheckpointingLayer

    from swiftlite.models.loader import load_model
    from swiftlite.tuners import prepare_model
    args = SftArguments(model="x", dataset=["x"], selective_checkpointing=True)
    for device, fused in (("cuda", False), ("cpu", True)):
        model = prepare_model(load_model(tiny_qwen2, "bfloat16"), args, device)
        lora = [m for m in model.modules() if isinstance(m, Linear)]
        assert lora and all(("_peft_forward" in vars(m)) == fused for m in lora)
        patched = [m for m in model.modules()
                   if type(m) is torch.nn.Linear and "forward" in vars(m)]  # fp32 activations
        assert bool(patched) == fused
        block = next(m for m in model.modules() if isinstance(m, GradientCheckpointingLayer))
        policy = "context_fn" in block._gradient_checkpointing_func.keywords
        assert policy == (not fused)


_LOAD_PEAK = (
    "import sys\n"
    "import swiftlite.models.loader as loader\n"
    "from swiftlite.memory import peak_rss_bytes\n"
    "import torch, transformers\n"
    "if sys.argv[2] == 'mapped':\n"
    "    loader.cast_state_dict = lambda *a: None  # transformers' own loading\n"
    "before = peak_rss_bytes()\n"
    "loader.load_model(sys.argv[1], 'bfloat16')\n"
    "print((peak_rss_bytes() - before) // 2**20)\n")


def test_model_cast_on_load_reads_one_tensor_at_a_time(smollm2, tiny_qwen2):
    """A checkpoint stored in fp32 and trained with a bf16 base (the CPU default): transformers
    maps the whole file and casts from the mapping, so the fp32 file is resident until loading
    ends; load_model reads and casts one tensor at a time instead. Measured on SmolLM2-135M
    (538 MB in fp32): the peak grows by 876 MB mapped vs 364 MB tensor by tensor. The model is
    the same: weights, buffers, tied head, config, generation config and name_or_path."""
    import swiftlite.models.loader as loader
    peak = {}
    for how in ("mapped", "cast"):
        out = subprocess.run([sys.executable, "-c", _LOAD_PEAK, smollm2, how],
                             capture_output=True, text=True, check=True)
        peak[how] = int(out.stdout.split()[-1])
    assert peak["cast"] < peak["mapped"] - 300, peak  # the fp32 file is 513 MiB

    ours = loader.load_model(tiny_qwen2, "bfloat16")
    assert loader.cast_state_dict(tiny_qwen2, torch.bfloat16) is not None  # the path taken
    assert loader.cast_state_dict(tiny_qwen2, torch.float32) is None  # nothing to cast
    real = loader.cast_state_dict
    try:
        loader.cast_state_dict = lambda *a: None
        theirs = loader.load_model(tiny_qwen2, "bfloat16")
    finally:
        loader.cast_state_dict = real
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert {t.dtype for t in a.values()} == {torch.bfloat16}
    assert [n for n, _ in ours.named_buffers()] == [n for n, _ in theirs.named_buffers()]
    assert all(torch.equal(x, y) for x, y in zip(ours.buffers(), theirs.buffers()))
    assert ours.config.to_dict() == theirs.config.to_dict()
    assert ours.name_or_path == theirs.name_or_path == tiny_qwen2
    assert ours.generation_config.to_dict() == theirs.generation_config.to_dict()
    tied = ours.get_output_embeddings().weight is ours.get_input_embeddings().weight
    assert tied == (theirs.get_output_embeddings().weight is theirs.get_input_embeddings().weight)


def test_selective_checkpointing_says_full_fine_tuning_has_nothing_to_keep(tiny_qwen2, capsys):
    """Torch's selective policy keeps outputs of matmuls whose weight is frozen; full
    fine-tuning trains every weight, so the policy would only add its per-op dispatch hook.
    prepare_model says so and installs plain checkpointing; LoRA gets the policy."""
    from swiftlite.models.loader import load_model
    from swiftlite.tuners import prepare_model
    for train_type, policy in (("full", False), ("lora", True)):
        args = SftArguments(model="x", dataset=["x"], train_type=train_type,
                            selective_checkpointing=True, fused_lora=False)
        model = prepare_model(load_model(tiny_qwen2, "float32"), args)
        layer = next(m for m in model.modules() if hasattr(m, "_gradient_checkpointing_func"))
        assert ("context_fn" in layer._gradient_checkpointing_func.keywords) == policy
        err = capsys.readouterr().err
        assert ("nothing to keep, so plain gradient checkpointing" in err) == (not policy), err
