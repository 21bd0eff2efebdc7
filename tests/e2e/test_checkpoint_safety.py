"""Checkpoints that are poisoned, damaged or cut short by a full disk are never used, and the
run says so in a sentence: each test is named for the failure it prevents (issue #41) and
trains or resumes a real tiny-qwen2 run."""
import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest

from helpers.cli import copy_run

import swiftlite
from swiftlite import cli
from swiftlite.errors import RunError
from swiftlite.errors import UsageError
from swiftlite.runtime.output import COMPLETE_MARKER, checkpoints, is_complete, last_checkpoint

TINY = ["--model", "tiny-qwen2", "--per_device_train_batch_size", "2",
        "--gradient_accumulation_steps", "1", "--torch_dtype", "float32", "--report_to", "none"]


def _non_finite(ckpt) -> int:
    import torch
    from safetensors.torch import load_file
    tensors = load_file(os.path.join(ckpt, "adapter_model.safetensors"))
    return sum(int((~torch.isfinite(t)).sum()) for t in tensors.values())


# -- a diverging run ---------------------------------------------------------------------------
@pytest.mark.parametrize("lr,save_steps", [
    (1e30, 3),  # the loss turns nan at step 2, between logging steps (the case)
    (1e39, 1),  # inf in fp32: the first update makes the weights non-finite, its loss was finite
])
def test_a_diverging_run_never_marks_a_non_finite_checkpoint_complete(tmp_path, chat_jsonl,
                                                                      tiny_qwen2, lr, save_steps):
    """Before: checkpoint-3 held 16,384 nan adapter values, was marked complete and was the
    run's last checkpoint (the loss was checked only at logging steps)."""
    out = tmp_path / "out"
    with pytest.raises(RunError, match="stopped") as e:
        swiftlite.sft(model="tiny-qwen2", dataset=[chat_jsonl + "#32"], max_steps=5,
                      per_device_train_batch_size=2, gradient_accumulation_steps=1,
                      learning_rate=lr, warmup_ratio=0.0, lr_scheduler_type="constant",
                      save_steps=save_steps, logging_steps=5,
                      torch_dtype="float32", report_to="none", output_dir=str(out))
    (run,) = out.iterdir()
    for _, ckpt in checkpoints(run):
        assert not is_complete(ckpt) or _non_finite(ckpt) == 0, ckpt
    assert last_checkpoint(str(run)) is None
    assert "no complete checkpoint" in str(e.value), str(e.value)


# -- a damaged checkpoint ----------------------------------------------------------------------
@pytest.fixture
def run_copy(tiny_run, tmp_path):
    """A copy of the session's tiny run (complete checkpoints 4 and 8) to damage."""
    run = tmp_path / "run"
    copy_run(tiny_run.output_dir, run)
    return run


def _damage(path, how: str) -> None:
    with open(path, "r+b") as f:
        if how == "truncate":  # a full disk, an interrupted copy
            f.truncate(os.path.getsize(path) // 2)
        else:  # a flipped byte in the middle: same size, other content (a disk error)
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.slow
def test_a_damaged_checkpoint_is_refused_before_anything_loads(run_copy, chat_jsonl, tmp_path,
                                                                capsys):
    """Before: the resume check passed, the model loaded, and torch's 'PytorchStreamReader failed
    reading zip archive' traceback ended the run (exit 1), leaving an orphan v1-*/args.json."""
    from swiftlite.training.resume import resolve_resume
    ckpt8, ckpt4 = run_copy / "checkpoint-8", run_copy / "checkpoint-4"
    saved = (ckpt8 / "optimizer.pt").read_bytes()
    _damage(ckpt8 / "optimizer.pt", "truncate")
    out = tmp_path / "out"
    rc = cli.main(["sft", *TINY, "--dataset", chat_jsonl, "--max_steps", "10", "--output_dir",
                   str(out), "--resume_from_checkpoint", str(run_copy)])  # the run: its last
    err = capsys.readouterr().err
    assert rc == 2 and "optimizer.pt" in err and f"Resume from {ckpt4}" in err, err[-2000:]
    assert not out.exists()  # refused before the run folder was made
    (ckpt8 / "optimizer.pt").write_bytes(saved)
    assert resolve_resume(str(run_copy)) == str(ckpt8)  # whole again
    _damage(ckpt8 / "adapter_model.safetensors", "flip")
    with pytest.raises(UsageError, match=r"adapter_model\.safetensors .*changed"):
        resolve_resume(str(ckpt8))
    # A marker written before sizes and hashes were recorded is accepted, and the files are
    # still checked for being cut short.
    marker = json.loads((ckpt4 / COMPLETE_MARKER).read_text())
    (ckpt4 / COMPLETE_MARKER).write_text(json.dumps(
        {k: marker[k] for k in ("step", "files", "time")}))
    assert resolve_resume(str(ckpt4)) == str(ckpt4)
    (ckpt4 / COMPLETE_MARKER).write_text("")  # how the message says to vouch for a checkpoint
    assert resolve_resume(str(ckpt4)) == str(ckpt4)  # older than markers
    _damage(ckpt4 / "rng_state.pth", "truncate")
    with pytest.raises(UsageError, match=r"rng_state\.pth"):
        resolve_resume(str(ckpt4))



@pytest.mark.slow
def test_a_checkpoint_that_fails_to_load_leaves_no_run_folder(tiny_run, chat_jsonl, tmp_path,
                                                              capsys):
    """A start that fails once its run folder exists (here the checkpoint's LoRA rank is not
    this run's, found only when the Trainer loads it) removes that folder and says what to do.
    Before: a traceback (exit 1) and an orphan v0-*/args.json for every try."""
    out = tmp_path / "out"
    rc = cli.main(["sft", *TINY, "--dataset", chat_jsonl, "--max_steps", "10", "--output_dir",
                   str(out), "--lora_rank", "4", "--resume_from_checkpoint",
                   tiny_run.last_checkpoint])
    err = capsys.readouterr().err
    assert rc == 2 and "could not be loaded" in err and "size mismatch" in err, err[-3000:]
    assert not out.exists()


def test_resuming_a_deepspeed_checkpoint_someone_else_wrote_is_warned_about(run_copy, capsys):
    """DeepSpeed loads its own checkpoint files with pickle (weights_only=False in DeepSpeed
    0.19.8), which runs any code a crafted file holds: one line says so when the checkpoint's
    run folder has no args.json of swiftlite's or its files belong to another user."""
    from swiftlite.training.resume import resolve_resume
    ckpt = run_copy / "checkpoint-8"
    (ckpt / "latest").write_text("global_step8")  # what DeepSpeed's resume reads first
    assert resolve_resume(str(ckpt), "lora", "zero2") == str(ckpt)
    assert "pickle" not in capsys.readouterr().err  # the user's own run: nothing to say
    assert resolve_resume(str(ckpt), "lora", None) == str(ckpt)
    (run_copy / "args.json").unlink()  # a folder from elsewhere
    resolve_resume(str(ckpt), "lora", "zero2")
    err = capsys.readouterr().err
    assert err.count("WARNING") == 1 and "pickle" in err and "no args.json" in err, err
    if os.geteuid() == 0:  # only root can give a file away
        (run_copy / "args.json").write_text(json.dumps({"command": "swiftlite sft"}))
        os.chown(ckpt / "latest", 4321, 4321)
        resolve_resume(str(ckpt), "lora", "zero2")
        err = capsys.readouterr().err
        assert "uid 4321" in err and err.count("WARNING") == 1, err


# -- a disk that fills -------------------------------------------------------------------------
def _ignore_sigxfsz():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG


@pytest.mark.slow
def test_a_disk_that_fills_while_training_stops_with_a_sentence(tmp_path, chat_jsonl,
                                                                tiny_qwen2):
    """Once checkpoint-2 is complete, the run's file size limit (RLIMIT_FSIZE) is lowered to
    32 KiB: every later write past it fails, as on a full disk (with EFBIG where a full disk
    gives ENOSPC; a full filesystem cannot be mounted here). Before: a raw OSError traceback."""
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "swiftlite.cli", "sft", *TINY, "--dataset", chat_jsonl + "#32",
         "--max_steps", "60", "--save_steps", "2", "--logging_steps", "1",
         "--output_dir", str(out), "--add_version", "false"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=_ignore_sigxfsz)
    marker = out / "checkpoint-2" / COMPLETE_MARKER
    deadline = time.time() + 600
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.002)
    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (32 * 1024, resource.RLIM_INFINITY))
    err = proc.communicate(timeout=600)[1]
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    last = last_checkpoint(str(out))
    assert last is not None and f"{last}, is intact" in err, err[-2000:]
    assert "size limit" in err and str(out) in err
    from swiftlite.runtime.output import damaged_files
    assert damaged_files(last) == []
