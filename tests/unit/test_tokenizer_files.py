"""save_tokenizer lists the added tokens in tokenizer_config.json, as the models' own files
have them: transformers 5 leaves them out when it saves, then parses all of tokenizer.json once
more at each load to find them. Listed, a load parses it less and gives the same tokenizer."""
from __future__ import annotations

import json
import os

import pytest

TEXT = "Hi <|im_start|>user\n你好<|im_end|><tool_call>{}</tool_call><think>x</think><|endoftext|>"


def _json_reads_of_tokenizer_json(folder, monkeypatch) -> tuple[int, object]:
    """How many times Python's json parses folder's tokenizer.json during one AutoTokenizer
    load, and the tokenizer it gives."""
    from transformers import AutoTokenizer
    reads = []
    real = json.load

    def counting(f, *a, **k):
        if os.path.basename(getattr(f, "name", "")) == "tokenizer.json":
            reads.append(f.name)
        return real(f, *a, **k)
    monkeypatch.setattr(json, "load", counting)
    tok = AutoTokenizer.from_pretrained(folder)
    monkeypatch.setattr(json, "load", real)
    return len(reads), tok


@pytest.mark.parametrize("alias", ["tiny-qwen2", "tiny-qwen3", "SmolLM2-135M-Instruct"])
def test_listed_added_tokens_load_with_fewer_parses_and_the_same_tokenizer(alias, tmp_path,
                                                                            monkeypatch):
    from transformers import AutoTokenizer

    from swiftlite.models.builtin import build
    from swiftlite.models.loader import save_tokenizer
    tok = AutoTokenizer.from_pretrained(build(alias))
    plain, listed = str(tmp_path / "plain"), str(tmp_path / "listed")
    tok.save_pretrained(plain)
    save_tokenizer(tok, listed)
    config = json.load(open(os.path.join(listed, "tokenizer_config.json"), encoding="utf-8"))
    assert {int(i): t["content"] for i, t in config["added_tokens_decoder"].items()} == \
        {i: t.content for i, t in tok.added_tokens_decoder.items()}
    parses_plain, a = _json_reads_of_tokenizer_json(plain, monkeypatch)
    parses_listed, b = _json_reads_of_tokenizer_json(listed, monkeypatch)
    assert parses_listed == parses_plain - 1, (parses_plain, parses_listed)
    assert type(a) is type(b)
    assert a(TEXT)["input_ids"] == b(TEXT)["input_ids"]
    assert a.added_tokens_decoder == b.added_tokens_decoder
    assert (a.eos_token, a.pad_token, a.all_special_ids) == (b.eos_token, b.pad_token,
                                                             b.all_special_ids)
    assert a.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False) == \
        b.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)


def test_checkpoints_and_built_in_models_list_them(tiny_run, tiny_qwen2):
    for folder in (tiny_qwen2, tiny_run.last_checkpoint):
        config = json.load(open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8"))
        assert config["added_tokens_decoder"]["151645"]["content"] == "<|im_end|>", folder
