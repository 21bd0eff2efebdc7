"""End to end on tiny-qwen2 (a real Qwen2ForCausalLM with the real Qwen2 tokenizer)."""
import json
import os
import shutil

import pytest
import torch

from helpers.cli import CHAT_ROWS, run_cli, write_jsonl

pytestmark = pytest.mark.slow


def read_log(run_dir):
    with open(os.path.join(run_dir, "logging.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_run_layout_and_loss_falls(tiny_run):
    run = tiny_run.output_dir
    assert os.path.basename(run).startswith("v0-")
    for name in ("args.json", "logging.jsonl", "metrics.json", "images/train_loss.png", "runs"):
        assert os.path.exists(os.path.join(run, name)), name
    # (other tests may add checkpoint-8-merged next to them: count the Trainer's own only)
    assert sorted(d for d in os.listdir(run) if d.startswith("checkpoint-") and
                  d.split("-")[1].isdigit() and "-merged" not in d) == ["checkpoint-4", "checkpoint-8"]
    ckpt = tiny_run.last_checkpoint
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json",
                 "chat_template.jinja", "args.json", "trainer_state.json"):
        assert os.path.exists(os.path.join(ckpt, name)), name
    args = json.load(open(os.path.join(run, "args.json")))
    assert args["template"] == "model" and args["torch_dtype"] in ("float32", "bfloat16")
    assert args["model_dir"] and args["dataset_report"]["samples"] == 32
    rows = [r for r in read_log(run) if "loss" in r]
    assert len(rows) == 8
    losses = [r["loss"] for r in rows]  # random tiny model: starts at ln(vocab) ~ 11.9
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.25, losses
    assert all(r["tokens_per_s"] > 0 and r["peak_rss_mb"] > 0 for r in rows[1:])


def test_adapter_loads_with_plain_peft(tiny_run, tiny_qwen2):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, tiny_run.last_checkpoint)
    tok = AutoTokenizer.from_pretrained(tiny_run.last_checkpoint)
    ids = tok.apply_chat_template(CHAT_ROWS[0]["messages"], return_tensors="pt",
                                  return_dict=True)["input_ids"]
    with torch.no_grad():
        trained = model(ids).logits
        with model.disable_adapter():
            plain = model(ids).logits
    assert (trained - plain).abs().max() > 1e-3  # the adapter learned something


def test_checkpointing_keeps_base_bit_identical_and_trains_adapters(tiny_qwen2, chat_jsonl,
                                                                    tmp_path):
    """The sft parts (tuners + trainer) under gradient checkpointing: LoRA weights move, every
    base weight stays bit-identical."""
    from swiftlite.config.arguments import SftArguments
    from swiftlite.data import load_conversations
    from swiftlite.data.encode import encode_dataset
    from swiftlite.runtime.hardware import detect
    from swiftlite.models.loader import load_model, load_tokenizer
    from swiftlite.data.template import get_template
    from swiftlite.training.trainer import build_trainer
    from swiftlite.training.tuners import prepare_model

    args = SftArguments(model=tiny_qwen2, dataset=[chat_jsonl], max_steps=3,
                        per_device_train_batch_size=2, gradient_accumulation_steps=1,
                        learning_rate=1e-2, training_args={"report_to": "none",
                                                           "save_strategy": "no"})
    tok = load_tokenizer(tiny_qwen2)
    convs, _ = load_conversations(args.dataset)
    ds, _ = encode_dataset(convs * 4, get_template("qwen", tok), max_length=256, use_cache=False)
    model = prepare_model(load_model(tiny_qwen2, "float32"), args)
    assert model.base_model.model.is_gradient_checkpointing
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    build_trainer(model, tok, ds, None, args, str(tmp_path), "float32", detect()).train()
    moved = base_same = 0
    for n, p in model.named_parameters():
        if "lora_" in n:
            moved += not torch.equal(p, before[n])
        else:
            assert torch.equal(p, before[n]), f"base weight {n} changed"
            base_same += 1
    assert moved > 0 and base_same > 0


def test_resume_matches_uninterrupted(tiny_run, chat_jsonl, tmp_path):
    """Resuming from checkpoint-4 of the 8-step run gives the same losses for steps 5..8."""
    import swiftlite
    ckpt4 = os.path.join(tiny_run.output_dir, "checkpoint-4")
    resumed = swiftlite.sft(model="tiny-qwen2", dataset=[chat_jsonl + "#32"], max_steps=8,
                            per_device_train_batch_size=4, gradient_accumulation_steps=1,
                            learning_rate=2e-2, save_steps=4, logging_steps=1,
                            output_dir=str(tmp_path), report_to="none", torch_dtype="float32",
                            resume_from_checkpoint=ckpt4)
    full = {r["step"]: r["loss"] for r in read_log(tiny_run.output_dir) if "loss" in r}
    after = {r["step"]: r["loss"] for r in read_log(resumed.output_dir) if "loss" in r}
    assert sorted(after) == [5, 6, 7, 8]
    for step, loss in after.items():
        assert loss == pytest.approx(full[step], abs=1e-4), (step, loss, full[step])


def test_bad_data_stops_before_the_model_loads_and_leaves_no_folder(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [CHAT_ROWS[0], '{"messages": 5}'])
    out = tmp_path / "out"
    r = run_cli("sft", "--model", "tiny-qwen2", "--dataset", data, "--output_dir", out,
                check=False)
    assert r.returncode == 2
    assert f"{data}:2" in r.stderr and "Traceback" not in r.stderr
    assert "Loading weights" not in r.stderr
    assert not out.exists()


def test_base_model_with_chat_template_warns(tiny_qwen2, chat_jsonl, tmp_path):
    base = tmp_path / "base-model"
    shutil.copytree(tiny_qwen2, base)
    for name in ("swiftlite.json", "chat_template.jinja"):
        if (base / name).exists():
            (base / name).unlink()
    cfg = json.load(open(base / "tokenizer_config.json"))
    cfg.pop("chat_template", None)
    json.dump(cfg, open(base / "tokenizer_config.json", "w"))
    r = run_cli("sft", "--model", base, "--dataset", chat_jsonl, "--template", "qwen",
                "--max_steps", "1", "--output_dir", tmp_path / "o", "--report_to", "none")
    assert "is a base model" in r.stderr and "--template default" in r.stderr
    args = json.load(open(next((tmp_path / "o").glob("v0-*")) / "args.json"))
    assert args["model_type"] == "base"
    # Without --template, a base model gets the plain `default` template.
    r = run_cli("sft", "--model", base, "--dataset", chat_jsonl, "--max_steps", "1",
                "--output_dir", tmp_path / "o", "--report_to", "none")
    assert "is a base model" not in r.stderr
    args = json.load(open(next((tmp_path / "o").glob("v1-*")) / "args.json"))
    assert args["template"] == "default"


def test_custom_dataset_example_with_validation_runs(tmp_path):
    """examples/sft_custom_dataset.yaml as a user runs it: several formats, #N sampling and a
    validation set, giving eval_loss in the log and its plot."""
    from helpers.cli import REPO
    r = run_cli("sft", os.path.join(REPO, "examples", "sft_custom_dataset.yaml"),
                "--output_dir", tmp_path, cwd=REPO)
    run = next(tmp_path.glob("v0-*"))
    rows = read_log(run)
    assert any("eval_loss" in row for row in rows), rows
    assert (run / "images" / "eval_loss.png").exists()
    # 3 messages rows + alpaca#6 (3 rows, repeated): 6 read, 9 samples
    assert "dataset: 6 rows read -> 9 samples (#N sampling)" in r.stderr
    assert "val: 2 samples of 2" in r.stderr  # the validation set is described like the train set


def test_two_runs_in_one_process_each_get_their_tensorboard_folder(chat_jsonl, tmp_path):
    import swiftlite
    runs = [swiftlite.sft(model="tiny-qwen2", dataset=[chat_jsonl], max_steps=1,
                          output_dir=str(tmp_path)).output_dir for _ in range(2)]
    assert runs[0] != runs[1]
    for run in runs:
        events = os.listdir(os.path.join(run, "runs"))
        assert any(e.startswith("events.out.tfevents") for e in events), (run, events)
