"""Arguments and the CLI: flags, config files, TrainingArguments pass-through, clear errors."""
import glob
import os
import subprocess
import sys
import time

import pytest

from swiftlite.config.arguments import SftArguments
from swiftlite.config.parsing import build, load_config_file
from swiftlite.config.argv import parse_argv
from swiftlite.errors import UsageError

from helpers.cli import REPO, run_cli


def parse(*argv):
    return parse_argv(SftArguments, list(argv), "swiftlite sft", "")


def test_flags_with_underscores_or_dashes_and_types():
    a = parse("--model", "tiny-qwen2", "--dataset", "a.jsonl", "b.jsonl#5", "--max-length", "512",
              "--lora_rank", "16", "--gradient_checkpointing", "false", "--learning_rate", "2e-4",
              "--target_modules", "q_proj", "v_proj", "--skip_bad_rows")
    assert a.dataset == ["a.jsonl", "b.jsonl#5"] and a.max_length == 512 and a.lora_rank == 16
    assert a.gradient_checkpointing is False and a.learning_rate == 2e-4 and a.skip_bad_rows
    assert a.target_modules == ["q_proj", "v_proj"]


def test_training_arguments_pass_through():
    a = parse("--model", "m", "--dataset", "d.jsonl", "--report_to", "none", "--eval_strategy",
              "no", "--dataloader_num_workers", "2", "--bf16", "false", "--max_steps", "-1")
    assert a.training_args == {"report_to": "none", "eval_strategy": "no",
                               "dataloader_num_workers": 2, "bf16": False}
    assert a.max_steps == -1


@pytest.mark.parametrize("argv,message", [
    (["--modle", "x"], "unknown argument(s) --modle (did you mean --model?)"),
    (["--lora_rank", "abc"], "--lora_rank: expected a whole number, got 'abc'"),
    (["--gradient_checkpointing", "maybe"], "expected true or false"),
])
def test_bad_flags_name_the_flag(argv, message):
    with pytest.raises(UsageError) as e:
        parse("--model", "m", "--dataset", "d.jsonl", *argv)
    assert message in str(e.value)


def test_validate_collects_every_problem():
    with pytest.raises(UsageError) as e:
        build(SftArguments, {"lora_rank": 0, "split_dataset_ratio": 2}).validate()
    msg = str(e.value)
    for part in ("--model is required", "--dataset is required", "--lora_rank must be",
                 "--split_dataset_ratio must be"):
        assert part in msg


def test_config_file_and_overrides(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: tiny-qwen2\ndataset: [x.jsonl]\nlora_rank: 4\nreport_to: none\n")
    a = parse(str(cfg), "--lora_rank", "16")
    assert a.model == "tiny-qwen2" and a.lora_rank == 16 and a.training_args["report_to"] == "none"
    cfg.write_text("model: tiny-qwen2\nlora_rnk: 4\n")
    with pytest.raises(UsageError, match="config file .*--lora_rnk.*did you mean --lora_rank"):
        parse(str(cfg))
    cfg.write_text("model: [unclosed\n")
    with pytest.raises(UsageError, match="cannot parse"):
        parse(str(cfg))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "examples", "*.yaml"))))
def test_every_example_config_loads_and_validates(path):
    from swiftlite.config.rlhf_args import RlhfArguments
    values = load_config_file(path)
    kind = RlhfArguments if os.path.basename(path).startswith("rlhf") else SftArguments
    args = build(kind, values, where=path).validate()
    assert args.model and args.dataset
    for spec in args.dataset:  # example data files exist
        file = spec.split("#")[0]
        if file.endswith(".jsonl"):
            assert os.path.exists(os.path.join(REPO, file)), file


def test_help_is_fast_and_lists_flags():
    t = time.time()
    r = subprocess.run([sys.executable, "-m", "swiftlite.cli", "sft", "--help"],
                       capture_output=True, text=True)
    # < 1 s on an idle machine; loose here, CI shares the cores (what it imports:
    # test_allocator.py::test_sft_help_is_instant)
    assert time.time() - t < 5, "swiftlite sft --help must answer in seconds"
    assert r.returncode == 0 and "--lora_rank" in r.stdout and "--dataset" in r.stdout
    r = subprocess.run([sys.executable, "-m", "swiftlite.cli", "--help"], capture_output=True,
                       text=True)
    assert r.returncode == 0 and "merge-lora" in r.stdout


def test_cli_errors_exit_2_without_traceback(tmp_path):
    r = run_cli("sft", "--model", "tiny-qwen2", "--dataset", "d.jsonl", "--lora_rank", "x",
                check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--lora_rank: expected a whole number" in r.stderr
    r = run_cli("sfft", check=False)
    assert r.returncode == 2 and "did you mean 'sft'" in r.stderr


def test_unknown_model_is_a_clear_error(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"query": "a", "response": "b"}\n')
    r = run_cli("sft", "--model", "Qwen9-1B", "--dataset", str(data), check=False)
    assert r.returncode == 2 and "--model Qwen9-1B" in r.stderr and "Known aliases" in r.stderr
    r = run_cli("sft", "--model", "tiny-qwn2", "--dataset", str(data), check=False)
    assert r.returncode == 2 and "Did you mean tiny-qwen2?" in r.stderr
    assert "dataset:" not in r.stderr  # said before the data is read
    r = run_cli("sft", "--model", "SomeOrg/not-downloaded", "--dataset", str(data), check=False,
                env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and "SomeOrg/not-downloaded" in r.stderr
    assert "pass its local folder" in r.stderr


@pytest.mark.slow
def test_training_arguments_transformers_rejects_are_usage_errors(tmp_path):
    """Pass-through TrainingArguments that cannot work are usage errors before any run folder
    exists: evaluation without evaluation data (checked with the other flags, before the data
    is read), transformers' own consistency checks, and an optimizer whose library is missing
    (bitsandbytes is not a dependency, so it is missing here)."""
    with pytest.raises(UsageError, match="--eval_strategy steps needs data to evaluate on"):
        parse("--model", "m", "--dataset", "d.jsonl", "--eval_strategy", "steps").validate()
    parse("--model", "m", "--dataset", "d.jsonl", "--eval_strategy", "steps",
          "--split_dataset_ratio", "0.1").validate()
    # YAML reads an unquoted `no` as false: it means "no" for a text field.
    assert build(SftArguments, {"model": "m", "dataset": ["d"], "eval_strategy": False}
                 ).validate().training_args["eval_strategy"] == "no"
    # A DeepSpeed config with its own optimizer (the offload presets) leaves --optim unused.
    import types
    from swiftlite.training.deepspeed import load_config
    from swiftlite.training.trainer import _check_optimizer
    offload = load_config("zero3_offload")
    assert "optimizer" in offload
    _check_optimizer(types.SimpleNamespace(deepspeed=offload, optim="adamw_bnb_8bit"), None)
    import importlib.util
    cases = [(["--load_best_model_at_end", "true", "--save_strategy", "epoch"],
              "transformers rejects these training arguments")]
    if importlib.util.find_spec("bitsandbytes") is None:  # not a dependency; absent here
        cases.append((["--optim", "adamw_bnb_8bit"], "--optim adamw_bnb_8bit: You need to install"))
    out = tmp_path / "out"
    for extra, message in cases:
        r = run_cli("sft", "--model", "tiny-qwen2", "--dataset", "self-cognition#8",
                    "--max_steps", "1", "--output_dir", str(out), *extra, check=False)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert message in r.stderr
        assert not out.exists()


@pytest.mark.slow
def test_target_modules_typo_is_reported_before_the_weights_load(tmp_path):
    """Checked on the meta-device build of the model's config (no weights read), with the
    names the model has; peft's own check would come only after loading."""
    r = run_cli("sft", "--model", "tiny-qwen2", "--dataset", "self-cognition#8",
                "--target_modules", "q_proj", "vproj", "--output_dir", str(tmp_path / "out"),
                check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "--target_modules vproj: no such module in this model" in r.stderr
    assert "v_proj" in r.stderr and "Loading weights" not in r.stderr
    assert not (tmp_path / "out").exists()
    # A single string is a regex to peft (Python API): not checked by name, left to peft.
    from swiftlite.models.meta import meta_model, read_config
    from swiftlite.models.targets import check_target_modules
    model = meta_model(*read_config("tiny-qwen2"))[1]
    check_target_modules(model, r".*\.(q|v)_proj")
    check_target_modules(model, ["self_attn.q_proj", "embed_tokens", "lm_head"])


def test_targets_peft_cannot_adapt_and_unknown_modules_to_save_are_refused_before_loading():
    """Found by an audit, each seen failing first: `--target_modules mlp` (a block, not a layer
    LoRA adapts) passed the name check and failed once the weights had loaded; a
    `--modules_to_save` typo trained nothing extra, and the log still named it."""
    from swiftlite.errors import UsageError
    from swiftlite.models.builtin import build
    from swiftlite.models.targets import check_target_modules_before_loading
    model_dir = build("tiny-qwen2")
    for targets in (["mlp"], ["q_proj", "input_layernorm"], r".*\.self_attn"):
        with pytest.raises(UsageError, match="not a layer LoRA can adapt"):
            check_target_modules_before_loading(model_dir, targets)
    with pytest.raises(UsageError, match="--modules_to_save lm_hed: no such module"):
        check_target_modules_before_loading(model_dir, "all-linear", modules_to_save=["lm_hed"])
    check_target_modules_before_loading(model_dir, ["q_proj"], modules_to_save=["lm_head", "norm"])

