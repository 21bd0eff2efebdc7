"""Guards that stop a run with advice instead of a traceback or garbage: out-of-memory
(the tuning ladder, read from the current arguments) and non-finite loss. Both are
triggered for real: an address-space limit makes PyTorch's CPU allocator fail, and a huge
learning rate makes a real tiny-qwen2 diverge."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

from helpers.cli import REPO
from swiftlite.config.arguments import SftArguments
from swiftlite.runtime.hardware import Hardware
from swiftlite.training.oom import advice, is_oom, ladder, zero_setup



def args(**kw) -> SftArguments:
    return SftArguments(model="Qwen2-1.5B-Instruct", dataset=["d.jsonl"], **kw)


def flags(a, world=1, hw=None):
    return [f for f, _ in ladder(a, world, hw)]


def test_ladder_starts_with_batch_one_keeping_the_total_batch():
    steps = flags(args(per_device_train_batch_size=4, gradient_accumulation_steps=2), world=2)
    # 4 x 2 accumulation per process -> 1 x 8 keeps 16 samples per optimizer step on 2 GPUs
    assert steps[0] == "--per_device_train_batch_size 1 --gradient_accumulation_steps 8"
    assert "--gradient_checkpointing true" not in steps  # on by default
    assert steps[1:5] == ["--deepspeed zero2", "--deepspeed zero2_offload", "--deepspeed zero3",
                          "--deepspeed zero3_offload"]


def test_ladder_order_from_nothing_to_everything():
    a = args(gradient_checkpointing=False, torch_dtype="float32", train_type="full",
             per_device_train_batch_size=2, gradient_accumulation_steps=None)
    gpu = Hardware("cuda", "NVIDIA A10", (8, 6), count=2)
    assert flags(a, 2, gpu) == [
        "--per_device_train_batch_size 1 --gradient_accumulation_steps 8",  # default total 16
        "--gradient_checkpointing true", "--deepspeed zero2", "--deepspeed zero2_offload",
        "--deepspeed zero3", "--deepspeed zero3_offload", "--torch_dtype bfloat16",
        "--train_type lora", "--max_length 1024"]
    t4 = Hardware("cuda", "Tesla T4", (7, 5))
    assert "--torch_dtype float16" in flags(a, 1, t4)


@pytest.mark.parametrize("current,world,expected_next", [
    ("zero2", 2, "--deepspeed zero2_offload"),
    ("zero2_offload", 2, "--deepspeed zero3"),
    ("zero3", 2, "--deepspeed zero3_offload"),
    ("zero1", 4, "--deepspeed zero2"),
    # one process: partitioning saves nothing, so straight to offloading
    (None, 1, "--deepspeed zero2_offload"),
    ("zero2_offload", 1, "--deepspeed zero3_offload"),
])
def test_next_step_depends_on_the_current_deepspeed_setting(current, world, expected_next):
    assert flags(args(deepspeed=current), world)[0] == expected_next


def test_ladder_leaves_out_the_steps_the_lora_variant_refuses():
    """QLoRA, DoRA and PiSSA/OLoRA are refused under ZeRO-3, LoRA+ with an offloaded optimizer: the
    advice after an out-of-memory error must not send the user into those refusals."""
    assert flags(args(use_dora=True), 2)[:3] == [
        "--deepspeed zero2", "--deepspeed zero2_offload", "--max_length 1024"]
    assert not any("zero3" in f for f in flags(args(init_lora_weights="pissa"), 2))
    assert [f for f in flags(args(lora_plus_lr_ratio=16.0), 2) if "deepspeed" in f] == [
        "--deepspeed zero2", "--deepspeed zero3"]
    assert not any("zero3" in f for f in flags(args(quant_bits=4), 2))  # QLoRA: no ZeRO-3


def test_zero3_offload_is_the_last_deepspeed_step_and_json_configs_are_read(tmp_path):
    assert not any("deepspeed" in f for f in flags(args(deepspeed="zero3_offload"), 2))
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer":
                                                     {"device": "cpu"}}}))
    assert zero_setup(str(cfg)) == (2, True, False)
    assert flags(args(deepspeed=str(cfg)), 2)[0] == "--deepspeed zero3"
    assert zero_setup('{"zero_optimization": {"stage": 3}}') == (3, False, False)


def test_advice_names_the_flags_and_the_estimate_command():
    text = advice(args(per_device_train_batch_size=8), 1, None, "CUDA out of memory")
    assert text.splitlines()[1].startswith(
        "Next step: --per_device_train_batch_size 1 --gradient_accumulation_steps 16")
    assert "swiftlite estimate --model Qwen2-1.5B-Instruct --gpus 1" in text


def test_no_offload_steps_on_a_cpu_host():
    cpu = Hardware("cpu", "cpu")
    assert flags(args(), 1, cpu) == ["--max_length 1024"]
    assert flags(args(), 2, cpu) == ["--deepspeed zero2", "--deepspeed zero3",
                                     "--max_length 1024"]


def test_is_oom_recognises_the_allocators_messages():
    import torch
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(RuntimeError("NPU out of memory. Tried to allocate 1.00 GiB"))
    assert is_oom(MemoryError())
    assert not is_oom(RuntimeError("shape mismatch"))
    assert not is_oom(ValueError("out of memory"))  # not an allocator's error type


OOM_SCRIPT = textwrap.dedent("""
    import resource, sys
    import torch, transformers, peft  # noqa: F401  (loaded before the limit)
    from swiftlite import cli
    status = open("/proc/self/status").read().split("VmSize:")[1].split()[0]
    limit = int(status) * 1024 + 1024 * 2**20  # what is mapped now + 1 GiB
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
    sys.exit(cli.main(sys.argv[1:]))
""")


@pytest.mark.slow
def test_real_out_of_memory_is_answered_with_the_next_step(tmp_path):
    """A real allocation failure: 1 GiB of address space beyond what is mapped after the
    imports, and a batch of 64 samples whose logits alone (tokens x 151936 x 4 bytes) need
    more than that."""
    r = subprocess.run(
        [sys.executable, "-c", OOM_SCRIPT, "sft", "--model", "tiny-qwen2", "--dataset",
         "self-cognition#64", "--max_steps", "2", "--per_device_train_batch_size", "64",
         "--gradient_accumulation_steps", "1", "--gradient_checkpointing", "false",
         # fp32 and the model's own loss: the full logits must exist, whatever the defaults
         "--torch_dtype", "float32", "--chunked_loss", "false",
         "--output_dir", str(tmp_path), "--report_to", "none"],
        capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert "can't allocate memory" in r.stderr  # PyTorch's CPU allocator really failed
    assert ("Next step: --per_device_train_batch_size 1 --gradient_accumulation_steps 64"
            in r.stderr)
    # a CPU host: no offloading to CPU is suggested
    assert "then: --gradient_checkpointing true; then --max_length 1024" in r.stderr


@pytest.mark.slow
def test_diverging_loss_stops_the_run(tmp_path):
    """lr 1e20 on a full fine-tune makes the weights overflow to inf after one step; the
    next logged step has a NaN loss (the Trainer's NaN filter is off) and the run stops."""
    import swiftlite
    from swiftlite.errors import RunError
    with pytest.raises(RunError) as e:
        swiftlite.sft(model="tiny-qwen2", dataset=["self-cognition#16"], train_type="full",
                      max_steps=4, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                      learning_rate=1e20, warmup_ratio=0, logging_steps=1, save_steps=100,
                      torch_dtype="float32",
                      output_dir=str(tmp_path), report_to="none")
    msg = str(e.value)
    assert "became nan at step 2" in msg and "lower --learning_rate" in msg
    run_dir = next(p for p in tmp_path.iterdir() if p.is_dir())
    rows = [json.loads(line) for line in open(run_dir / "logging.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]  # stopped at step 2 of 4
    assert math.isfinite(rows[0]["loss"]) and math.isnan(rows[1]["loss"])


def _guard_log(hw, fp16: bool, loss, grad_norm):
    from types import SimpleNamespace

    from swiftlite.training.callbacks import NonFiniteLossGuard
    guard = NonFiniteLossGuard(hw)
    guard.on_log(SimpleNamespace(fp16=fp16), SimpleNamespace(global_step=3), None,
                 logs={"loss": loss, "grad_norm": grad_norm})
    return guard


def test_an_fp16_overflow_step_is_counted_not_stopped(capsys):
    """Under fp16 the loss scaler skips a step whose gradients overflow (grad_norm inf, loss
    finite) and lowers its scale: a healthy run, counted and reported at the end."""
    from types import SimpleNamespace
    t4 = Hardware("cuda", "Tesla T4", (7, 5))
    guard = _guard_log(t4, True, 2.5, math.inf)
    assert guard.skipped == 1
    guard.on_train_end(SimpleNamespace(fp16=True), None, None)
    assert "the loss scaler skipped 1 logged step(s)" in capsys.readouterr().err
    from swiftlite.errors import RunError
    with pytest.raises(RunError, match="gradient norm became inf"):  # not fp16: stops
        _guard_log(t4, False, 2.5, math.inf)


@pytest.mark.parametrize("gpu, advice, not_advised", [
    (("Tesla T4", (7, 5)), "--torch_dtype float32 (this device has no bf16)", "bfloat16"),
    (("NVIDIA A10", (8, 6)), "--torch_dtype bfloat16", "float32"),
])
def test_fp16_nan_advice_is_possible_on_the_hardware(gpu, advice, not_advised):
    from swiftlite.errors import RunError
    with pytest.raises(RunError) as e:
        _guard_log(Hardware("cuda", *gpu), True, math.nan, math.nan)
    assert "loss became nan at step 3" in str(e.value) and advice in str(e.value)
    assert not_advised not in str(e.value)


def test_out_of_memory_while_the_model_moves_to_the_gpu_gets_the_ladder(tmp_path,
                                                                        monkeypatch):
    """The Trainer moves the model to the GPU when it is built, before training: a CUDA OOM
    there (simulated: there is no GPU here, so building the Trainer raises the error CUDA
    would) is answered with the next step too, and leaves no run folder."""
    import torch

    import swiftlite
    from swiftlite.errors import RunError
    from swiftlite.training import trainer

    def no_room(*a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; "
                                     "14.56 GiB total capacity)")

    monkeypatch.setattr(trainer, "build_trainer", no_room)
    with pytest.raises(RunError) as e:
        swiftlite.sft(model="tiny-qwen2", dataset=["self-cognition#4"], max_steps=1,
                      output_dir=str(tmp_path / "out"), report_to="none")
    assert str(e.value).startswith("out of memory (CUDA out of memory. Tried to allocate")
    assert "\nNext step: --" in str(e.value) and "swiftlite estimate --model" in str(e.value)
    assert not os.path.exists(tmp_path / "out") or not os.listdir(tmp_path / "out")
