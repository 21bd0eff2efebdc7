"""What a training command's start imports (#42): parsing reads TrainingArguments' fields from
the cache instead of importing transformers (config/ta_fields.py), and a run that does not use
bitsandbytes leaves it out (runtime/imports.py)."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import types

import pytest

from swiftlite.config import parsing
from swiftlite.config.ta_fields import annotation_text, training_arguments_fields
from swiftlite.runtime import imports


def test_the_kept_text_converts_every_field_as_its_annotation_does():
    from transformers import TrainingArguments
    for f in dataclasses.fields(TrainingArguments):
        if not f.init:
            continue
        text = annotation_text(f.type)
        assert parsing.base_type(text) == parsing.base_type(f.type), (f.name, f.type, text)
        assert parsing._also_scalar(text) == parsing._also_scalar(f.type), (f.name, text)
        assert parsing._accepts(text, dict) == parsing._accepts(f.type, dict), (f.name, text)


PARSE = """
import sys
from swiftlite.config.arguments import SftArguments
from swiftlite.config.argv import parse_argv
from swiftlite.errors import UsageError
args = parse_argv(SftArguments, ["--model", "m", "--dataset", "d", "--dataloader_drop_last",
                                 "--report_to", "none", "--lr_scheduler_kwargs", "{}"], "t", "")
try:
    parse_argv(SftArguments, ["--model", "m", "--dataset", "d", "--dataloader_drop_lst"], "t", "")
except UsageError as e:
    hint = str(e)
print("transformers" in sys.modules, sorted(args.training_args.items()),
      "dataloader_drop_last" in hint)
"""


def test_a_parse_reads_the_kept_fields_without_importing_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTLITE_CACHE", str(tmp_path))
    fields = training_arguments_fields()  # the first parse here imports and keeps them
    (kept,) = (tmp_path / "transformers").iterdir()
    assert json.loads(kept.read_text()) == fields and fields["max_steps"] == "int"
    kept.write_text('{"max_steps": ')  # torn: imported again and written whole
    assert training_arguments_fields() == fields == json.loads(kept.read_text())
    r = subprocess.run([sys.executable, "-c", PARSE], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "SWIFTLITE_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split("\n")[0] == (
        "False [('dataloader_drop_last', True), ('lr_scheduler_kwargs', '{}'), "
        "('report_to', 'none')] True")  # converted and checked by the kept fields


SFT = """
import gc, json, sys
from swiftlite.cli import main
threshold, full = gc.get_threshold(), []  # full: the frozen objects as each full collection began
gc.callbacks.append(lambda phase, info: phase == "start" and info["generation"] == 2
                    and full.append(gc.get_freeze_count()))
sys.argv = ["swiftlite", "sft", "--model", "tiny-qwen2", "--dataset", "self-cognition#8",
            "--max_steps", "2", "--report_to", "none", "--output_dir", sys.argv[1]]
assert main() == 0
print(json.dumps({"left_out": [m for m in ("bitsandbytes", "deepspeed", "scipy")
                               if m in sys.modules and sys.modules[m] is None],
                  "full": full, "frozen": gc.get_freeze_count(),
                  "threshold_back": gc.get_threshold() == threshold}))
"""


@pytest.mark.slow
def test_a_run_starts_without_unused_libraries_and_without_full_collections(tiny_qwen2,
                                                                              tmp_path):
    """`swiftlite sft` leaves bitsandbytes, DeepSpeed and SciPy out before peft, transformers'
    models and the Trainer would import them, and trains the same; no full garbage collection
    runs before the first step, and from there on they run as before, without the objects the
    run keeps (runtime/gc_start.py)."""
    env = {**os.environ, "SWIFTLITE_ALLOCATOR": "glibc", "SWIFTLITE_PREFETCH": "0"}
    r = subprocess.run([sys.executable, "-c", SFT, str(tmp_path / "out")], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["left_out"] == ["bitsandbytes", "deepspeed", "scipy"]
    assert all(frozen > 0 for frozen in seen["full"]), seen["full"]  # none while starting
    assert seen["frozen"] > 100_000 and seen["threshold_back"] is True
    assert "loss" in r.stderr + r.stdout


def test_full_collections_are_held_only_until_released():
    """hold/release restore the collector's own thresholds; a release without a hold (the
    Python API: cli.main is not the process's command) changes nothing."""
    import gc

    from swiftlite.runtime import gc_start
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    try:
        gc_start.release(freeze=True)
        assert gc.get_threshold() == before and gc.get_freeze_count() == frozen
        gc_start.hold()
        gc_start.hold()  # a second hold keeps the first one's thresholds to restore
        assert gc.get_threshold()[:2] == before[:2] and gc.get_threshold()[2] > 10**6
        kept = [object() for _ in range(10)]
        gc_start.release(freeze=True)
        assert gc.get_threshold() == before and gc.get_freeze_count() > frozen
        assert kept
    finally:
        gc.set_threshold(*before)
        gc_start.unfreeze()
    assert gc.get_freeze_count() == frozen


def test_an_out_of_memory_error_leaves_a_callers_own_freeze_alone():
    """The Python API: a caller that froze its objects itself, then ran out of memory in a
    run (training.oom.free_memory); only what gc_start froze is unfrozen."""
    import gc

    from swiftlite.training.oom import free_memory
    gc.freeze()  # the caller's
    try:
        frozen = gc.get_freeze_count()
        free_memory()
        # still frozen (an unfreeze empties it; a few frozen objects may be freed meanwhile)
        assert frozen > 0 and gc.get_freeze_count() > frozen // 2
    finally:
        gc.unfreeze()


def test_a_library_stays_for_the_runs_that_use_it_and_for_the_python_api(monkeypatch):
    """bitsandbytes for a 4-bit base and its optimizers, DeepSpeed for --deepspeed (auto too);
    the Python API keeps all three. (A run with --quant_bits through the CLI: test_qlora.py's
    two-process run; with --deepspeed: test_deepspeed.py.) SciPy, which no run uses, is left
    out of each of these runs: in a copy of sys.modules, so this test process keeps it."""
    used = ("bitsandbytes", "deepspeed")
    monkeypatch.setattr(imports, "command_process", True)
    for args in (dict(quant_bits=4, training_args={}, deepspeed="zero2"),
                 dict(quant_bits=None, training_args={"optim": "adamw_bnb_8bit"},
                      deepspeed="auto"),
                 dict(quant_bits=None, training_args={"optim": "paged_lion_32bit"},
                      deepspeed={"zero_optimization": {"stage": 2}})):
        modules = {m: v for m, v in sys.modules.items() if m != "scipy"}
        monkeypatch.setattr(sys, "modules", modules)
        imports.leave_out_unused(types.SimpleNamespace(**args))
        monkeypatch.undo()
        assert all(m not in modules or modules[m] is not None for m in used), args
        assert "scipy" in modules and modules["scipy"] is None, args
        monkeypatch.setattr(imports, "command_process", True)
    before = {m: sys.modules.get(m, "absent") for m in (*used, "scipy")}
    monkeypatch.setattr(imports, "command_process", False)  # swiftlite.sft(...) from Python
    imports.leave_out_unused(types.SimpleNamespace(quant_bits=None, training_args={},
                                                   deepspeed=None))
    assert {m: sys.modules.get(m, "absent") for m in before} == before
