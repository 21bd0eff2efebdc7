"""The LoRA variants (DoRA, rsLoRA, the inits, lora_bias, modules_to_save, a regex target,
LoRA+, NEFTune): swiftlite's model with its speed-ups equals plain peft's on the same batch, the
saved adapter gives the same logits in plain peft, and PiSSA/OLoRA checkpoints are converted
for the original base (merge-lora and resume included)."""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from swiftlite.config.arguments import SftArguments

from helpers.marks import slow_bf16_math
from helpers.speedups import _assert_close_grads, _batch, _grads

# peft's warning for lora_bias on layers without a bias, which swiftlite names at start (tested
# below). Left to reach pytest-xdist's controller, its class (peft's PeftWarning) would make that
# process import peft, torch and transformers to show it.
pytestmark = pytest.mark.filterwarnings("ignore:`lora_bias=True` was passed")


@pytest.fixture(scope="module")
def tiny_qwen25() -> str:
    from swiftlite.models.builtin import build
    return build("tiny-qwen2.5")


# name -> (swiftlite's arguments, the LoraConfig a peft user would write for them); each case
# combines variants that go together, to keep to four model pairs
VARIANTS = {
    "dora-rslora-gaussian": ({"use_dora": True, "use_rslora": True, "init_lora_weights": "gaussian"},
                             {"use_dora": True, "use_rslora": True, "init_lora_weights": "gaussian"}),
    "pissa-regex": ({"init_lora_weights": "pissa_niter_2", "target_modules": [r".*\.(q|v)_proj"]},
                    {"init_lora_weights": "pissa_niter_2", "target_modules": r".*\.(q|v)_proj"}),
    "olora-rslora": ({"init_lora_weights": "olora", "use_rslora": True},
                     {"init_lora_weights": "olora", "use_rslora": True}),
    "lora_bias-modules_to_save": (
        {"lora_bias": True, "modules_to_save": ["lm_head"]},
        {"lora_bias": True, "modules_to_save": ["lm_head"], "ensure_weight_tying": True}),
}
ASIDE = {"dora-rslora-gaussian", "lora_bias-modules_to_save"}  # fused LoRA steps aside


# Every norm of a 2-layer model (5 modules), named so under any peft: 0.22 stopped matching "norm"
# to input_layernorm (models.targets.saved).
NORMS = ["norm", "input_layernorm", "post_attention_layernorm"]


def _args(**kw) -> SftArguments:
    return SftArguments(model="x", dataset=["x"], lora_dropout=0.0, **kw)


def _perturb(model, seed=3):
    """lora_B (zero at init) and the saved copies get values, the same in both models."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.requires_grad and ("lora_B" in name or "modules_to_save" in name):
                p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _swiftlite_model(model_dir, args, capfd=None):
    from swiftlite.models.loader import load_model
    from swiftlite.training.tuners import prepare_model
    base = load_model(model_dir, "float32")
    torch.manual_seed(0)
    model = prepare_model(base, args)
    log = capfd.readouterr().err if capfd is not None else ""
    _perturb(model)
    return model.train(), log


def _peft_model(model_dir, peft_kwargs):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # with the KV cache on, transformers skips the per-sample mask of a padding-free batch
    base.config.use_cache = False
    config = LoraConfig(**{"r": 8, "lora_alpha": 32, "lora_dropout": 0.0,
                           "target_modules": "all-linear", "task_type": "CAUSAL_LM",
                           **peft_kwargs})
    torch.manual_seed(0)
    model = get_peft_model(base, config)
    _perturb(model)
    return model.train()


def _loss_and_grads(model, batch, chunked: bool):
    from swiftlite.training.speedups.chunked_loss import supervised_head_loss
    model.zero_grad()
    loss = supervised_head_loss(model, batch) if chunked else model(**batch).loss
    loss.backward()
    return loss.item(), _grads(model)


def _logits(model, batch):
    model.eval()
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                    use_cache=False).logits
    model.train()
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_equals_plain_peft_and_saves_for_plain_peft(tiny_qwen25, variant, tmp_path,
                                                           capfd):
    """swiftlite's model (fused LoRA, fast dropout, checkpointing, chunked loss: what steps
    aside says so once) has plain peft's loss and gradients on one batch; after a step its
    saved adapter, loaded by PeftModel.from_pretrained on the original base, gives its logits
    (PiSSA/OLoRA: converted for the original base)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    ours_kw, peft_kw = VARIANTS[variant]
    _, _, batch = _batch(tiny_qwen25)
    ours, log = _swiftlite_model(tiny_qwen25, _args(**ours_kw), capfd)
    plain = _peft_model(tiny_qwen25, peft_kw)
    assert log.count("--fused_lora steps aside") == (variant in ASIDE)
    assert ("--lora_bias on layers without a bias of their own (down_proj gate_proj o_proj "
            "up_proj)" in log) == ("lora_bias" in variant)
    fused = sum("_peft_forward" in vars(m) for m in ours.modules())
    assert (fused == 0) == (variant in ASIDE)
    loss, grads = _loss_and_grads(ours, batch, chunked=True)
    plain_loss, plain_grads = _loss_and_grads(plain, batch, chunked=False)
    assert loss == pytest.approx(plain_loss, rel=1e-5)
    _assert_close_grads(plain_grads, grads)
    with torch.no_grad():  # one step, so that the saved adapter is not the initial one
        for p in ours.parameters():
            if p.grad is not None:
                p.sub_(p.grad * 0.5)
    with warnings.catch_warnings(record=True) as caught:
        ours.save_pretrained(str(tmp_path))
    # peft's check for ungathered ZeRO-3 shards counts lora_B's biases (1-D): not shown for them
    shape_warnings = [str(w.message) for w in caught if "invalid shape" in str(w.message)]
    assert not shape_warnings, shape_warnings[0]
    if "lora_bias" in variant:  # and shown when it counts anything else
        from peft.utils.save_and_load import _validate_lora_adapter_state_dict
        biases = sum(n.endswith(".bias") and ".lora_B." in n for n, _ in ours.named_parameters())
        for flagged in (biases + 1, biases):  # a 1-D lora_A weight first, then the biases
            state = {"m.lora_A.weight": torch.zeros(8),
                     **{f"m{i}.lora_B.bias": torch.zeros(4) for i in range(flagged - 1)}}
            with warnings.catch_warnings(record=True) as caught:
                _validate_lora_adapter_state_dict(state, "default")
            assert ["invalid shape" in str(w.message) for w in caught] == [True], flagged
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    if variant.startswith(("pissa", "olora")):  # plain LoRA of rank 2r for the original base
        assert saved["r"] == 16 and saved["init_lora_weights"] is True
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen25, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(tmp_path))
    want = _logits(ours, batch)
    assert (want - _logits(loaded, batch)).abs().max().item() < 1e-4 * want.abs().max().item()


@pytest.mark.slow
def test_smollm2_variants_equal_plain_peft(smollm2):
    """The same on SmolLM2 (the real model, 30 layers), DoRA with rsLoRA (on q_proj and v_proj:
    DoRA recomputes each adapted weight's norm at every call, slow on a CPU)."""
    kw = {"use_dora": True, "use_rslora": True}
    _, _, batch = _batch(smollm2)
    ours, _ = _swiftlite_model(smollm2, _args(**kw, target_modules=["q_proj", "v_proj"]))
    loss, grads = _loss_and_grads(ours, batch, chunked=True)
    del ours
    plain = _peft_model(smollm2, {**kw, "target_modules": ["q_proj", "v_proj"]})
    plain_loss, plain_grads = _loss_and_grads(plain, batch, chunked=False)
    assert loss == pytest.approx(plain_loss, rel=1e-5)
    _assert_close_grads(plain_grads, grads)


@slow_bf16_math
def test_modules_to_save_learn_on_a_16_bit_base(tiny_qwen25, capfd):
    """A bf16 base (--torch_dtype auto on a bf16 CPU or GPU): peft copies the --modules_to_save
    modules in the base's dtype, where AdamW's steps on a weight near 1 (1e-4 at lr 1e-4) are
    below bf16's resolution (2^-7): the copies would not change at all. They train in fp32,
    the log says so, and the frozen originals stay as loaded."""
    from swiftlite.models.loader import load_model
    from swiftlite.training.tuners import prepare_model
    _, _, batch = _batch(tiny_qwen25)
    model = prepare_model(load_model(tiny_qwen25, "bfloat16"),
                          _args(modules_to_save=NORMS)).train()
    assert (f"modules_to_save {' '.join(sorted(NORMS))}: 5 modules trained whole in fp32"
            in capfd.readouterr().err)
    copies = {n: p for n, p in model.named_parameters() if "modules_to_save" in n}
    originals = {n: p for n, p in model.named_parameters() if "original_module" in n}
    assert len(copies) == len(originals) == 5
    assert {p.dtype for p in copies.values()} == {torch.float32}
    assert {p.dtype for p in originals.values()} == {torch.bfloat16}
    before = {n: p.detach().clone() for n, p in {**copies, **originals}.items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    for _ in range(3):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    for n, p in copies.items():  # every value moved, the largest by about 3 steps of lr
        assert (p.detach() != before[n]).all(), n
        assert (p.detach() - before[n]).abs().max() > 2e-4, n
    assert all(torch.equal(p, before[n]) for n, p in originals.items())
    # bf16 activations without autocast (--fp32_activations false on a CPU): fp32 copies would
    # hand fp32 to the bf16 layers after them, so they stay bf16, and the log says why
    model = prepare_model(load_model(tiny_qwen25, "bfloat16"),
                          _args(modules_to_save=NORMS, fp32_activations=False)).train()
    assert "the copies train in bf16" in capfd.readouterr().err
    assert {p.dtype for n, p in model.named_parameters() if p.requires_grad} == {
        torch.float32, torch.bfloat16}  # the LoRA weights (peft's own upcast) and the copies
    assert torch.isfinite(model(**batch).loss)


def test_fp32_copies_load_back_exactly_and_deepspeed_on_a_gpu_keeps_its_own(tiny_qwen25,
                                                                            tmp_path):
    """Training on from a saved adapter (rlhf after sft, `--adapters`): the fp32 copies it
    holds come back bit for bit, not rounded through the base's bf16 on the way in. Under
    DeepSpeed on a GPU the copies are left to DeepSpeed, which casts the model to its 16-bit
    dtype and keeps fp32 master weights (prepare_model for a GPU, run here on the CPU model:
    only the decision is checked; the GPU run itself needs a GPU)."""
    from swiftlite.models.loader import load_model
    from swiftlite.training.tuners import prepare_model
    model = prepare_model(load_model(tiny_qwen25, "bfloat16"), _args(modules_to_save=NORMS))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "modules_to_save" in n:
                p.add_(torch.full_like(p, 1e-4))  # a trained step bf16 cannot hold near 1
    saved = {n: p.detach().clone() for n, p in model.named_parameters()
             if "modules_to_save" in n}
    model.save_pretrained(tmp_path)
    again = prepare_model(load_model(tiny_qwen25, "bfloat16"), _args(), adapter=str(tmp_path))
    loaded = {n: p for n, p in again.named_parameters() if "modules_to_save" in n}
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[n], saved[n]) for n in saved)
    on_gpu = prepare_model(load_model(tiny_qwen25, "bfloat16"),
                           _args(modules_to_save=NORMS, deepspeed="zero2"), device="cuda")
    assert {p.dtype for n, p in on_gpu.named_parameters() if "modules_to_save" in n} == {
        torch.bfloat16}


@pytest.fixture(scope="module")
def trainer(tiny_qwen25, tmp_path_factory):
    """swiftlite's SFT Trainer with --neftune_noise_alpha 5 and --lora_plus_lr_ratio 16."""
    from datasets import Dataset

    from swiftlite.runtime import hardware
    from swiftlite.training.trainer import build_trainer
    tok, samples, _ = _batch(tiny_qwen25)
    args = _args(neftune_noise_alpha=5.0, lora_plus_lr_ratio=16.0, learning_rate=1e-3,
                 max_steps=1, training_args={"report_to": ["none"]})
    model, _ = _swiftlite_model(tiny_qwen25, args)
    return build_trainer(model, tok, Dataset.from_list([dict(s) for s in samples]), None, args,
                         str(tmp_path_factory.mktemp("run")), "float32", hardware.detect())


def test_lora_plus_gives_lora_b_its_own_learning_rate(trainer):
    """peft's LoRA+ optimizer: every lora_B at 16 x --learning_rate, every lora_A at it."""
    optimizer = trainer.create_optimizer()
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    rates = {names[id(p)]: g["lr"] for g in optimizer.param_groups for p in g["params"]}
    assert len(rates) == sum(p.requires_grad for p in trainer.model.parameters())
    assert {round(lr, 9) for n, lr in rates.items() if "lora_B" in n} == {16e-3}
    assert {round(lr, 9) for n, lr in rates.items() if "lora_A" in n} == {1e-3}


def test_neftune_noises_training_not_inference_nor_the_reference(trainer):
    """--neftune_noise_alpha reaches TrainingArguments; with transformers' hook on (as
    Trainer.train puts it), the embeddings' output is noised in train mode only, and not in
    rlhf's reference (adapters off, same model)."""
    from transformers.integrations.neftune import activate_neftune, deactivate_neftune

    from swiftlite.training.preference.trainer import reference_model
    assert trainer.args.neftune_noise_alpha == 5.0
    model = trainer.model
    emb = model.get_input_embeddings()
    ids = torch.arange(100, 140)[None]
    with torch.no_grad():
        clean = emb(ids)
        handle = activate_neftune(model, trainer.neftune_noise_alpha, trainer.accelerator)
        try:
            model.train()
            assert (emb(ids) - clean).abs().max() > 1e-3
            with reference_model(model):
                assert torch.equal(emb(ids), clean)
            assert emb.training
            model.eval()
            assert torch.equal(emb(ids), clean)
        finally:
            model.train()
            deactivate_neftune(model, handle, trainer.accelerator)


def test_rlhf_trains_with_the_variants(tiny_qwen25, tmp_path):
    """DPO with DoRA, rsLoRA, LoRA+ and NEFTune: the run learns and saves a DoRA adapter that
    plain peft loads."""
    import json

    import swiftlite
    from helpers.cli import write_jsonl
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    pairs = [{"prompt": f"What is {a} plus 2?", "chosen": f"{a} plus 2 is {a + 2}.",
              "rejected": "No idea."} for a in range(8)]
    run = swiftlite.rlhf(model="tiny-qwen2.5", dataset=[write_jsonl(tmp_path / "p.jsonl", pairs)],
                         max_steps=4, per_device_train_batch_size=4, learning_rate=5e-3,
                         use_dora=True, use_rslora=True, lora_plus_lr_ratio=4.0,
                         neftune_noise_alpha=5.0, torch_dtype="float32", report_to="none",
                         logging_steps=1, output_dir=str(tmp_path / "dpo"))
    logged = [json.loads(line) for line in open(f"{run.output_dir}/logging.jsonl")]
    losses = [r["loss"] for r in logged if "loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    config = json.load(open(f"{run.last_checkpoint}/adapter_config.json"))
    assert config["use_dora"] and config["use_rslora"]
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_qwen25),
                              run.last_checkpoint)


def test_variant_refusals_are_said_before_loading():
    """The combinations peft cannot run are refused by validate, with the reason."""
    def problems(**kw):
        return " | ".join(_args(**kw).problems())
    assert "ZeRO-3 holds it partitioned" in problems(use_dora=True, deepspeed="zero3")
    assert "decomposition needs each whole base weight" in problems(
        init_lora_weights="olora", deepspeed={"zero_optimization": {"stage": 3}})
    assert "PiSSA refuses a quantized base" in problems(init_lora_weights="pissa", quant_bits=4)
    assert "would drop what these add" in problems(init_lora_weights="pissa", use_dora=True)
    assert "one or the other" in problems(use_dora=True, lora_bias=True)
    assert "B = 0" in problems(lora_bias=True, init_lora_weights="gaussian")
    assert "loftq" in problems(init_lora_weights="loftq")
    assert "choose one of" in problems(init_lora_weights="pissa_niter_0")
    assert "DeepSpeed's own optimizer" in problems(lora_plus_lr_ratio=4.0,
                                                   deepspeed="zero3_offload")
    assert "full fine-tuning" in problems(use_dora=True, train_type="full")
    assert problems(use_dora=True, quant_bits=4, deepspeed="zero2") == ""
    assert problems(init_lora_weights="pissa_niter_4", use_rslora=True,
                    lora_plus_lr_ratio=16.0, neftune_noise_alpha=5.0) == ""


def test_variants_in_the_web_ui_and_the_estimate(tiny_qwen25):
    """The Web-UI's form lists every variant (its tuner section); the estimate counts DoRA's
    magnitudes and activations and modules_to_save's copies, and offers no ZeRO-3 to DoRA."""
    from swiftlite.estimate.memory import model_spec
    from swiftlite.estimate.plan import run
    from swiftlite.config.arguments import EstimateArguments
    from swiftlite.models.meta import read_config
    from swiftlite.webui import form
    for name in ("use_dora", "use_rslora", "lora_plus_lr_ratio", "init_lora_weights",
                 "neftune_noise_alpha", "modules_to_save", "lora_bias"):
        assert form.FIELDS[name].metadata["group"] == "tuner"
    name, config = read_config(tiny_qwen25)
    plain, dora = model_spec(name, config), model_spec(name, config, use_dora=True)
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]
    outputs = h + 2 * kv + h + 2 * i + h  # q k v o gate up down
    assert dora.trainable_params - plain.trainable_params == layers * outputs
    assert dora.dora_outputs_per_layer == outputs
    saved = model_spec(name, config, modules_to_save=["embed_tokens", "lm_head"])  # tied: one
    assert saved.trainable_params - plain.trainable_params == config["vocab_size"] * h
    # peft's own matching, which 0.22 changed: "norm" was the final norm and every
    # input/post-attention layernorm (a name ending with the entry), and is now the final norm.
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_qwen25))
    peft_model = get_peft_model(base, LoraConfig(r=8, target_modules="all-linear",
                                                 modules_to_save=["norm"]))
    peft_trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert model_spec(name, config, modules_to_save=["norm"]).trainable_params == peft_trainable
    from swiftlite.training.lora_variants import describe  # and the run log says how many
    copies = (peft_trainable - plain.trainable_params) // h  # peft's own count: a norm is h
    assert (f"modules_to_save norm: {copies} module{'s' * (copies > 1)} trained whole"
            in describe(peft_model.peft_config["default"], peft_model))
    rows = run(EstimateArguments(model=tiny_qwen25, use_dora=True, gpus=2))["rows"]
    assert [r["stage"] for r in rows if r["stage"].startswith("zero3")] == []
    with_dora = run(EstimateArguments(model=tiny_qwen25, use_dora=True))["rows"][0]
    without = run(EstimateArguments(model=tiny_qwen25))["rows"][0]
    assert with_dora["gpu"]["activations_no_ckpt"] > without["gpu"]["activations_no_ckpt"]


@pytest.mark.slow
def test_pissa_run_resumes_and_merges_to_base_plus_adapter(tiny_qwen25, chat_jsonl, tmp_path):
    """sft with --init_lora_weights pissa_niter_2: checkpoints are plain rank-2r adapters of the
    original base; resuming from the first gives the second exactly; merge-lora of it equals
    base + adapter in plain peft."""
    import swiftlite
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    common = dict(model=tiny_qwen25, dataset=[chat_jsonl + "#8"], max_steps=2, save_steps=1,
                  per_device_train_batch_size=4, gradient_accumulation_steps=1,
                  learning_rate=1e-2, torch_dtype="float32", add_version=False,
                  init_lora_weights="pissa_niter_2", report_to=["none"])
    swiftlite.sft(**common, output_dir=str(tmp_path / "a"))
    swiftlite.sft(**common, output_dir=str(tmp_path / "b"),
                  resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-1"))
    ckpt = str(tmp_path / "a" / "checkpoint-2")
    a, b = (load_file(os.path.join(str(tmp_path / run / "checkpoint-2"),
                                   "adapter_model.safetensors")) for run in ("a", "b"))
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert json.load(open(os.path.join(ckpt, "adapter_config.json")))["r"] == 16
    merged = swiftlite.merge_lora(ckpt, verify=False)
    ids = torch.arange(1000, 1032)[None]
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen25, dtype=torch.float32)
    with torch.no_grad():
        want = PeftModel.from_pretrained(base, ckpt).eval()(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)(
            input_ids=ids).logits
    assert (want - got).abs().max().item() < 1e-4


def test_variant_refusals_read_deepspeed_configs_and_targets(tmp_path, tiny_qwen25):
    """Each seen failing first (an audit): ZeRO-3 given as a JSON file or inline JSON passed
    the refusals that knew it by preset name, and an optimizer offloaded by a JSON config the
    LoRA+ one; PiSSA/OLoRA with LoRA on the embeddings or on a head tied to them saved a
    checkpoint that is not the model trained; rlhf --adapters took variant flags it ignores;
    the estimate advised --quant_bits, which PiSSA refuses."""
    from swiftlite.config.arguments import EstimateArguments
    from swiftlite.config.rlhf_args import RlhfArguments
    from swiftlite.errors import UsageError
    from swiftlite.estimate.plan import run
    from swiftlite.models.targets import check_target_modules_before_loading
    from swiftlite.pipelines.sft import preflight
    stage3 = {"zero_optimization": {"stage": 3}}
    (tmp_path / "z3.json").write_text(json.dumps(stage3))
    for ds in (str(tmp_path / "z3.json"), json.dumps(stage3)):
        for kw, words in (({"use_dora": True}, "ZeRO-3 holds it partitioned"),
                          ({"init_lora_weights": "pissa"}, "decomposition needs")):
            with pytest.raises(UsageError, match=words):
                preflight(_args(deepspeed=ds, output_dir=str(tmp_path / "out"), **kw))
    offload = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(UsageError, match="DeepSpeed's own optimizer"):
        preflight(_args(deepspeed=json.dumps(offload), lora_plus_lr_ratio=4.0,
                        output_dir=str(tmp_path / "out")))
    assert "embeddings" in " | ".join(_args(init_lora_weights="olora",
                                            target_modules=["embed_tokens", "q_proj"]).problems())
    with pytest.raises(UsageError, match="tied"):  # tiny-qwen2.5's head is its embeddings
        check_target_modules_before_loading(tiny_qwen25, ["lm_head", "q_proj"],
                                            init_lora_weights="pissa")
    check_target_modules_before_loading(tiny_qwen25, ["lm_head", "q_proj"])
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "adapter_config.json").write_text("{}")
    for kw in ({"use_dora": True}, {"lora_rank": 4}, {"target_modules": ["v_proj"]},
               {"modules_to_save": ["lm_head"]}, {"init_lora_weights": "gaussian"}):
        with pytest.raises(UsageError, match="--adapters continues"):
            RlhfArguments(model="m", dataset=["d"], adapters=[str(ckpt)], **kw).validate()
    RlhfArguments(model="m", dataset=["d"], adapters=[str(ckpt)],
                  lora_plus_lr_ratio=4.0).validate()
    plan = run(EstimateArguments(model="Qwen2-7B-Instruct", gpu_memory="16GB",
                                 init_lora_weights="pissa"))
    assert plan["recommendation"]["quant_bits"] is None, plan["recommendation"]
    with pytest.raises(UsageError, match="--init_lora_weights bogus"):
        EstimateArguments(model="m", init_lora_weights="bogus").validate()
