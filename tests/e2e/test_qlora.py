"""QLoRA (--quant_bits 4|8): bitsandbytes' real CPU kernels under tiny-qwen2, through the CLI
and the Python API: training, resume, plain peft, merge-lora, infer, ZeRO-2, the estimate, and
the combinations that are refused before anything loads."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os

import pytest

from swiftlite import cli

from helpers.cli import run_cli
from helpers.server import free_port

pytest.importorskip("bitsandbytes")

QLORA = dict(model="tiny-qwen2", dataset=["self-cognition#32"], per_device_train_batch_size=4,
             gradient_accumulation_steps=1, learning_rate=2e-2, logging_steps=1,
             report_to="none", quant_bits=4)


def losses(run_dir) -> dict[int, float]:
    with open(os.path.join(run_dir, "logging.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def folder_digest(path) -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            h.update(name.encode() + f.read())
    return h.hexdigest()


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory, tiny_qwen2):
    """8 steps of 4-bit nf4 QLoRA, checkpoints at 4 and 8; the base folder's digest before."""
    import swiftlite
    before = folder_digest(tiny_qwen2)
    out = tmp_path_factory.mktemp("qlora")
    result = swiftlite.sft(**QLORA, max_steps=8, save_steps=4, output_dir=str(out))
    return result, before


def _quantized(bits: int):
    from transformers import BitsAndBytesConfig
    import torch
    return BitsAndBytesConfig(load_in_8bit=True) if bits == 8 else BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32)


def _logits(model, ids):
    import torch
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def test_4bit_qlora_learns_and_leaves_the_base_untouched(qlora_run, tiny_qwen2):
    from safetensors import safe_open
    result, before = qlora_run
    run_dir = result.output_dir
    loss = losses(run_dir)
    assert loss[8] < loss[1] - 0.1, loss
    args = json.load(open(os.path.join(run_dir, "args.json")))
    assert args["quant_bits"] == 4 and args["bnb_4bit_quant_type"] == "nf4"
    with safe_open(os.path.join(result.last_checkpoint, "adapter_model.safetensors"), "pt") as f:
        assert f.keys() and all("lora_" in k for k in f.keys())  # only the adapters are saved
    assert folder_digest(tiny_qwen2) == before


def test_8bit_qlora_learns_on_tiny_qwen25(tmp_path):
    import swiftlite
    result = swiftlite.sft(**{**QLORA, "quant_bits": 8, "model": "tiny-qwen2.5"}, max_steps=4,
                           save_steps=4, output_dir=str(tmp_path))
    loss = losses(result.output_dir)
    assert loss[4] < loss[1] - 0.1, loss


@pytest.mark.slow
def test_lora_variants_learn_on_a_4bit_base_and_load_in_plain_peft(tmp_path, tiny_qwen2):
    """DoRA, rsLoRA, LoRA+ and NEFTune on the 4-bit base (peft's bitsandbytes layers): the
    loss falls, and plain peft on a 4-bit base computes what `swiftlite infer --quant_bits 4`
    does. (PiSSA/OLoRA/LoftQ with --quant_bits are refused: test_lora_variants.py.)"""
    import swiftlite
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from swiftlite.inference.engine import InferEngine
    result = swiftlite.sft(**QLORA, max_steps=6, save_steps=6, use_dora=True, use_rslora=True,
                           lora_plus_lr_ratio=4, neftune_noise_alpha=5,
                           output_dir=str(tmp_path))
    loss = losses(result.output_dir)
    assert loss[6] < loss[1] - 0.1, loss
    ckpt = result.last_checkpoint
    config = json.load(open(os.path.join(ckpt, "adapter_config.json")))
    assert config["use_dora"] is True and config["use_rslora"] is True
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
        tiny_qwen2, quantization_config=_quantized(4)), ckpt).eval()
    engine = InferEngine.load(ckpt_dir=ckpt, quant_bits=4)
    ids = engine.encode([{"role": "user", "content": "Who are you?"}])
    assert (_logits(plain, ids) - _logits(engine.model, ids)).abs().max() < 1e-5


def test_the_adapter_loads_in_plain_peft_on_a_quantized_base(qlora_run, tiny_qwen2):
    """A user without swiftlite: transformers + peft on the 4-bit base give what
    `swiftlite infer --quant_bits 4` computes."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from swiftlite.inference.engine import InferEngine
    ckpt = qlora_run[0].last_checkpoint
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
        tiny_qwen2, quantization_config=_quantized(4)), ckpt).eval()
    engine = InferEngine.load(ckpt_dir=ckpt, quant_bits=4)
    ids = engine.encode([{"role": "user", "content": "Who are you?"}])
    assert (_logits(plain, ids) - _logits(engine.model, ids)).abs().max() < 1e-5
    assert type(engine.model.base_model.model.model.layers[0].mlp.up_proj).__name__ == \
        "Linear4bit"


def test_resume_continues_the_losses(qlora_run, tmp_path):
    import swiftlite
    result, _ = qlora_run
    resumed = swiftlite.sft(**QLORA, max_steps=8, save_steps=4, output_dir=str(tmp_path),
                            resume_from_checkpoint=os.path.join(result.output_dir,
                                                                "checkpoint-4"))
    full, again = losses(result.output_dir), losses(resumed.output_dir)
    assert set(again) == {5, 6, 7, 8}
    for step in again:
        assert again[step] == pytest.approx(full[step], abs=1e-4), (step, full, again)


@pytest.mark.slow
def test_merge_gives_the_adapter_on_the_full_precision_base(qlora_run, tiny_qwen2):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    ckpt = qlora_run[0].last_checkpoint
    r = run_cli("merge-lora", "--ckpt_dir", ckpt)
    assert "adapter vs merged" in r.stdout and "4-bit base it was trained on vs merged" in r.stdout
    merged = ckpt + "-merged"
    ids = AutoTokenizer.from_pretrained(merged)("Who are you?")["input_ids"]
    full = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_qwen2), ckpt)
    plain = AutoModelForCausalLM.from_pretrained(merged)
    assert (_logits(plain.eval(), ids) - _logits(full.eval(), ids)).abs().max() < 1e-4
    assert not os.path.exists(os.path.join(merged, "adapter_config.json"))


@pytest.mark.parametrize("argv, message", [
    (["sft", "--train_type", "full", "--quant_bits", "4"], "train LoRA adapters on it"),
    (["sft", "--deepspeed", "zero3", "--quant_bits", "4"], "ZeRO-3 partitions the base"),
    (["sft", "--deepspeed", '{"zero_optimization": {"stage": 3}}', "--quant_bits", "4"],
     "ZeRO-3 partitions the base"),
    (["sft", "--quant_bits", "3"], "--quant_bits 3: bitsandbytes loads 4 or 8 bits"),
    (["sft", "--quant_method", "gptq", "--quant_bits", "4"], "only bnb"),
    (["merge-lora", "--ckpt_dir", ".", "--quant_bits", "4"], "would round the small LoRA"),
    (["deploy", "--quant_bits", "4", "--infer_backend", "vllm"], "serve the merged model"),
])
def test_bad_combinations_exit_2_before_loading(tmp_path, capsys, argv, message):
    model = [] if argv[0] == "merge-lora" else ["--model", "tiny-qwen2"]
    data = ["--dataset", "self-cognition#8", "--output_dir", str(tmp_path / "out")] \
        if argv[0] == "sft" else []
    rc = cli.main([*argv, *model, *data])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err
    assert not (tmp_path / "out").exists()


def test_without_bitsandbytes_the_message_says_how_to_install_it(tmp_path, capsys,
                                                                  monkeypatch):
    # Mocked: an environment without bitsandbytes (this one has it installed).
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    rc = cli.main(["sft", "--model", "tiny-qwen2", "--dataset", "self-cognition#8",
                   "--quant_bits", "4", "--output_dir", str(tmp_path / "out")])
    assert rc == 2 and "pip install bitsandbytes" in capsys.readouterr().err


def test_estimate_counts_4bit_weights_and_recommends_qlora_for_7b_on_a_t4():
    from swiftlite.config.arguments import EstimateArguments
    from swiftlite.estimate.memory import quantized_bytes_per_weight
    from swiftlite.estimate.plan import run
    t4 = dict(model="Qwen2.5-7B-Instruct", torch_dtype="float16", gpu_memory="16GB",
              max_length=2048)
    plain, q4 = run(EstimateArguments(**t4)), run(EstimateArguments(**t4, quant_bits=4))
    none = {r["stage"]: r for r in plain["rows"]}["none"]["gpu"]["params"]
    none4 = {r["stage"]: r for r in q4["rows"]}["none"]["gpu"]["params"]
    assert not any(r["stage"].startswith("zero3") for r in q4["rows"])
    # 16-bit linear weights become 4.127 bits each: the saving is 2 - 0.516 bytes per weight
    # (less one linear weight dequantized at a time).
    assert 0.3 < none4 / none < 0.4
    assert quantized_bytes_per_weight(4) == pytest.approx(4.127 / 8, abs=1e-3)
    choice = plain["recommendation"]
    assert choice["fits"] and choice["quant_bits"] == 4 and choice["deepspeed"] is None, choice
    assert "does not fit" in choice["reason"]


@pytest.mark.slow
def test_zero2_with_a_quantized_base_on_two_processes(tmp_path):
    env = {"NPROC_PER_NODE": "2", "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}
    run_cli("sft", "--model", "tiny-qwen2", "--dataset", "self-cognition#32", "--max_steps", "4",
            "--quant_bits", "4", "--deepspeed", "zero2", "--per_device_train_batch_size", "2",
            "--learning_rate", "2e-2", "--logging_steps", "1", "--report_to", "none",
            "--output_dir", tmp_path, env=env)
    (run_dir,) = [os.path.join(tmp_path, d) for d in os.listdir(tmp_path) if d.startswith("v")]
    loss = losses(run_dir)
    assert loss[4] < loss[1] - 0.1, loss
    assert os.path.isfile(os.path.join(run_dir, "checkpoint-4", "adapter_model.safetensors"))
