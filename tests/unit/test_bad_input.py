"""Bad input gets a clear message naming what is wrong and where (exit 2), and nothing is
written: every case below stops before a run folder exists. Each case crashed with a
traceback, trained on garbage, or hung before (see docs/reliability.md).

The cases run `swiftlite sft` in this process (cli.main), so each costs a fraction of a
second; the data and model checks come before any model is loaded."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from swiftlite import cli
from swiftlite.config.arguments import SftArguments
from swiftlite.config.argv import parse_argv
from swiftlite.data.loader import load_datasets

from helpers.cli import CHAT_ROWS, REPO, write_jsonl

ROW = json.dumps(CHAT_ROWS[0], ensure_ascii=False).encode()


def sft(tmp_path, capsys, *flags) -> str:
    """Run `swiftlite sft` here; assert exit 2 and no output folder; the error message."""
    out = tmp_path / "out"
    rc = cli.main(["sft", "--model", "tiny-qwen2", "--max_steps", "1",
                   "--output_dir", str(out), *map(str, flags)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert not out.exists(), f"a run folder was made: {os.listdir(out)}"
    return err


@pytest.fixture
def good(tmp_path):
    return write_jsonl(tmp_path / "good.jsonl", CHAT_ROWS)


def test_non_utf8_bytes_are_named_by_file_and_line(tmp_path, capsys, tiny_qwen2):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(ROW + b"\n" + ROW.replace(b"2+2", "caf\xe9".encode("latin-1")) + b"\n")
    err = sft(tmp_path, capsys, "--dataset", path)
    assert f"{path}:2: not UTF-8 text (byte 0xe9" in err and "save the file as UTF-8" in err


def test_a_utf8_bom_is_accepted_in_jsonl_json_and_csv(tmp_path):
    bom = b"\xef\xbb\xbf"
    (tmp_path / "a.jsonl").write_bytes(bom + ROW + b"\n")
    (tmp_path / "b.json").write_bytes(bom + b"[" + ROW + b"]")
    (tmp_path / "c.csv").write_bytes(bom + b"query,response\nWhat is 2+2?,4\n")
    for name in ("a.jsonl", "b.json", "c.csv"):
        loaded = load_datasets([str(tmp_path / name)])
        assert loaded.train[0]["messages"][0]["content"] == "What is 2+2?", name


def test_deeply_nested_json_is_a_bad_row_not_a_recursion_error(tmp_path, capsys, tiny_qwen2):
    path = tmp_path / "deep.jsonl"
    path.write_text(json.dumps(CHAT_ROWS[0]) + "\n" + '{"messages": ' + "[" * 100_000 +
                    "]" * 100_000 + "}\n")
    err = sft(tmp_path, capsys, "--dataset", path)
    assert f"{path}:2: invalid JSON (nested too deeply to read)" in err
    deep_json = tmp_path / "deep.json"
    deep_json.write_text("[" * 100_000 + "]" * 100_000)
    assert "nested too deeply" in sft(tmp_path, capsys, "--dataset", deep_json)


def test_csv_cells_beyond_the_csv_modules_limit_are_read(tmp_path):
    long_reply = "word " * 60_000  # 300,000 characters; the csv module stops at 131,072
    path = tmp_path / "long.csv"
    path.write_text(f'query,response\nWrite a lot.,"{long_reply}"\n', encoding="utf-8")
    loaded = load_datasets([str(path)])
    assert loaded.train[0]["messages"][-1]["content"] == long_reply


def test_non_utf8_csv_names_the_line(tmp_path, capsys, tiny_qwen2):
    path = tmp_path / "latin1.csv"
    path.write_bytes(b"query,response\nhello,hi\ncaf\xe9,ok\n")
    assert f"{path}:3: not UTF-8 text (byte 0xe9)" in sft(tmp_path, capsys, "--dataset", path)


def test_a_corrupt_parquet_file_is_named(tmp_path, capsys, tiny_qwen2):
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = tmp_path / "cut.parquet"
    pq.write_table(pa.table({"query": ["a"] * 100, "response": ["b"] * 100}), path)
    path.write_bytes(path.read_bytes()[:-20])  # a download cut short
    err = sft(tmp_path, capsys, "--dataset", path)
    assert f"--dataset {path}: not a readable parquet file" in err


def test_a_corrupt_config_json_is_named_before_the_data_is_read(tmp_path, capsys, tiny_qwen2,
                                                                 good):
    model = tmp_path / "model"
    shutil.copytree(tiny_qwen2, model)
    (model / "config.json").write_text('{"model_type": "qwen2",\n  "hidden_size": 64,\n')
    out = tmp_path / "out"
    rc = cli.main(["sft", "--model", str(model), "--dataset", good, "--output_dir", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and f"{model}/config.json:3: not valid JSON" in err and not out.exists()


def test_a_tokenizer_without_eos_is_refused(tmp_path, capsys, tiny_qwen2, good):
    model = tmp_path / "model"
    shutil.copytree(tiny_qwen2, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["eos_token"] = cfg["pad_token"] = None
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    rc = cli.main(["sft", "--model", str(model), "--dataset", good, "--output_dir", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "the tokenizer has no EOS token" in err and not out.exists()


def test_a_template_whose_stop_words_is_a_string_is_refused(tmp_path, capsys, tiny_qwen2, good):
    # A string would be read as a list of one-character stop words: "<", "|", "i", "m", ...
    spec = json.loads(open(os.path.join(REPO, "swiftlite", "templates", "chatml.json")).read())
    spec["stop_words"] = "<|im_end|>"
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(spec))
    err = sft(tmp_path, capsys, "--dataset", good, "--template", path)
    assert "'stop_words' must be a list of strings" in err


@pytest.mark.parametrize("flags, message", [
    (["--learning_rate", "nan"], "--learning_rate: expected a finite number, got 'nan'"),
    (["--learning_rate", "inf"], "--learning_rate: expected a finite number, got 'inf'"),
    (["--num_train_epochs", "nan", "--max_steps", "-1"], "--num_train_epochs: expected a finite"),
    (["--warmup_ratio", "nan"], "--warmup_ratio: expected a finite number"),  # pass-through
    (["--seed", "-1"], "--seed must be in 0 .. 4294967295, got -1"),
    (["--per_device_eval_batch_size", "0"], "--per_device_eval_batch_size must be a positive"),
])
def test_numbers_that_cannot_train_are_refused(tmp_path, capsys, good, flags, message):
    assert message in sft(tmp_path, capsys, "--dataset", good, *flags)


def test_yaml_values_of_the_wrong_type(tmp_path, capsys, good):
    # A number where a folder name goes is that name; a mapping is an error naming the file.
    config = tmp_path / "run.yaml"
    config.write_text(f"model: tiny-qwen2\ndataset: {good}\noutput_dir: 2024\n")
    assert parse_argv(SftArguments, [str(config)], "sft", "").output_dir == "2024"
    config.write_text(f"model: {{a: 1}}\ndataset: {good}\noutput_dir: {tmp_path / 'out'}\n")
    rc = cli.main(["sft", str(config)])
    err = capsys.readouterr().err
    assert rc == 2 and f"config file {config}: --model: expected text, got a mapping" in err
    assert not (tmp_path / "out").exists()


def test_sampling_more_rows_than_memory_holds_is_refused_before_building(tmp_path, capsys,
                                                                          tiny_qwen2, good):
    err = sft(tmp_path, capsys, "--dataset", f"{good}#1000000000")
    assert "1,000,000,000 samples" in err and "GiB is available" in err
