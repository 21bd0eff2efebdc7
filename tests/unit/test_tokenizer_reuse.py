"""load_tokenizer reads a folder's vocabulary once per process: a second load of the same files
shares it (the Rust backend, the slow part to read), and still gives its caller a tokenizer of
its own that equals a fresh one; changed files are read again."""
from __future__ import annotations

import json
import shutil

import pytest

from swiftlite.models.loader import load_tokenizer

TEXT = "Hello 你好 <|im_end|> world"


@pytest.fixture
def folder(tiny_qwen2, tmp_path):
    """A private copy of tiny-qwen2's tokenizer files (the tests rewrite them)."""
    out = tmp_path / "tok"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "chat_template.jinja"):
        shutil.copy(f"{tiny_qwen2}/{name}", out / name)
    return str(out)


@pytest.mark.parametrize("torch_free", [False, True])
def test_a_second_load_shares_the_vocabulary_and_equals_a_fresh_load(folder, torch_free):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    first, second = (load_tokenizer(folder, torch_free=torch_free) for _ in range(2))
    assert second is not first and second._tokenizer is first._tokenizer
    fresh = (PreTrainedTokenizerFast if torch_free else AutoTokenizer).from_pretrained(folder)
    assert type(second) is type(fresh)
    assert second(TEXT)["input_ids"] == fresh(TEXT)["input_ids"]
    assert second.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False) == \
        fresh.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert (second.eos_token, second.pad_token, second.all_special_ids) == (
        fresh.eos_token, fresh.pad_token or fresh.eos_token, fresh.all_special_ids)


def test_what_one_caller_sets_stays_its_own(folder):
    first = load_tokenizer(folder)
    first.chat_template = "{{ messages[0]['content'] }}"
    first.padding_side = "left"
    first.pad_token = "<|im_start|>"
    first.model_max_length = 7
    first.init_kwargs["extra"] = 1
    second = load_tokenizer(folder)
    assert second.chat_template != first.chat_template
    assert (second.padding_side, second.pad_token, second.model_max_length) == (
        "right", "<|endoftext|>", 32768)
    assert "extra" not in second.init_kwargs
    # padding and truncation on one (set on the shared vocabulary for each call) do not carry
    # over to the other's next call
    batch = first(["a", "a b c"], padding=True, truncation=True, max_length=2)
    assert [len(ids) for ids in batch["input_ids"]] == [2, 2]
    assert [len(ids) for ids in second(["a", "a b c"])["input_ids"]] == [1, 3]


def test_changed_files_are_read_again(folder):
    before = load_tokenizer(folder)
    path = f"{folder}/tokenizer_config.json"
    config = json.load(open(path))
    config["model_max_length"] = 123
    json.dump(config, open(path, "w"))
    after = load_tokenizer(folder)
    assert before.model_max_length == 32768 and after.model_max_length == 123
