"""Templates: exact token parity with the models' own chat templates, and label masks."""
import json

import pytest
from transformers import AutoTokenizer

from swiftlite.errors import UsageError
from swiftlite.config.constants import IGNORE_INDEX
from swiftlite.data.template import get_template, template_names

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi, how can I help?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."},
     {"role": "user", "content": "And Italy?"}, {"role": "assistant", "content": "Rome."}],
    [{"role": "user", "content": "用中文说你好"}, {"role": "assistant", "content": "你好！很高兴见到你。"},
     {"role": "user", "content": "emoji please 🎉🙂"}, {"role": "assistant", "content": "🎉🙂👍"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": ""},
     {"role": "assistant", "content": ""}],
    [{"role": "user", "content": "code:\n```py\nprint('x')\n```\n"},
     {"role": "assistant", "content": "  leading spaces and trailing newline\n"}],
]


@pytest.fixture(scope="module")
def tokenizers(tiny_qwen2, smollm2):
    return {"qwen": AutoTokenizer.from_pretrained(tiny_qwen2),
            "smollm": AutoTokenizer.from_pretrained(smollm2)}


@pytest.mark.parametrize("name", ["qwen", "smollm"])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_encode_matches_apply_chat_template(tokenizers, name, conv):
    tok = tokenizers[name]
    messages = CONVERSATIONS[conv]
    ids = get_template(name, tok).encode(messages)["input_ids"]
    assert ids == tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]


@pytest.mark.parametrize("name", ["qwen", "smollm"])
def test_labels_cover_every_reply_and_its_end_of_turn(tokenizers, name):
    tok = tokenizers[name]
    enc = get_template(name, tok).encode(CONVERSATIONS[1])
    trained = [i for i, l in zip(enc["input_ids"], enc["labels"]) if l != IGNORE_INDEX]
    assert tok.decode(trained) == "Paris.<|im_end|>Rome.<|im_end|>"
    for i, l in zip(enc["input_ids"], enc["labels"]):
        assert l in (IGNORE_INDEX, i)
    # The prompt parts (system, user, assistant headers) are never trained.
    assert enc["labels"][0] == IGNORE_INDEX


def test_empty_reply_still_trains_end_of_turn(tokenizers):
    enc = get_template("qwen", tokenizers["qwen"]).encode(CONVERSATIONS[3])
    trained = [i for i, l in zip(enc["input_ids"], enc["labels"]) if l != IGNORE_INDEX]
    assert tokenizers["qwen"].decode(trained) == "<|im_end|>"


@pytest.mark.parametrize("name", ["qwen", "smollm", "chatml", "llama3", "default"])
def test_jinja_export_renders_the_same_string(tokenizers, name):
    tok = tokenizers["qwen"]
    template = get_template(name, tok, system="Custom system." if name == "chatml" else None)
    tok2 = AutoTokenizer.from_pretrained(tok.name_or_path)
    tok2.chat_template = template.to_jinja()
    for messages in CONVERSATIONS:
        assert tok2.apply_chat_template(messages, tokenize=False) == template.render(messages)[0]
        prompt = messages[:-1]
        assert tok2.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) == \
            template.render(prompt, add_generation_prompt=True)[0]


def test_system_override_and_conversation_system_wins(tokenizers):
    t = get_template("qwen", tokenizers["qwen"], system="You are Swifty.")
    assert "You are Swifty." in t.render(CONVERSATIONS[0])[0]
    assert "You are terse." in t.render(CONVERSATIONS[1])[0]
    assert "You are Swifty." not in t.render(CONVERSATIONS[1])[0]


def test_default_template_ends_replies_with_eos(tokenizers):
    tok = tokenizers["smollm"]
    enc = get_template("default", tok).encode(CONVERSATIONS[0])
    trained = [i for i, l in zip(enc["input_ids"], enc["labels"]) if l != IGNORE_INDEX]
    assert trained[-1] == tok.eos_token_id
    assert tok.decode(trained).startswith("Hi, how can I help?")


def test_template_from_a_file_and_errors(tmp_path, tokenizers):
    spec = {"system": "S: {content}\n", "user": "U: {content}\n", "assistant_header": "A: ",
            "assistant": "{content}{eos_token}", "assistant_suffix": "\n"}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(spec))
    t = get_template(str(path), tokenizers["qwen"])
    assert t.render(CONVERSATIONS[0])[0] == "U: Hello!\nA: Hi, how can I help?<|im_end|>\n"
    with pytest.raises(UsageError, match="--template nope: unknown template.*qwen"):
        get_template("nope", tokenizers["qwen"])
    path.write_text(json.dumps({**spec, "bogus": 1}))
    with pytest.raises(UsageError, match="unknown keys"):
        get_template(str(path), tokenizers["qwen"])


def test_shipped_templates():
    assert {"qwen", "chatml", "smollm", "llama3", "default"} <= set(template_names())


def test_labels_train_the_tokens_that_start_inside_a_trained_span_and_cover_a_character():
    from swiftlite.config.constants import IGNORE_INDEX as X
    from swiftlite.data.template_base import _labels
    offsets = [(0, 2), (2, 2), (2, 5), (5, 6), (6, 9), (9, 9), (9, 12)]
    ids = [10, 11, 12, 13, 14, 15, 16]
    assert _labels(ids, offsets, [(1, 5), (9, 12)]) == [X, X, 12, X, X, X, 16]
    assert _labels(ids, offsets, []) == [X] * 7
    assert _labels(ids, offsets, [(0, 12)]) == [10, X, 12, 13, 14, X, 16]


@pytest.mark.parametrize("alias", ["tiny-qwen2", "tiny-qwen2.5", "tiny-qwen3",
                                   "SmolLM2-135M-Instruct"])
def test_the_torch_free_tokenizer_gives_the_same_template_and_tokens(alias):
    """export and deploy's vLLM backend read the template with load_tokenizer(torch_free=True):
    the same saved template, end-of-turn, stop ids and encoded conversation as AutoTokenizer."""
    from swiftlite.data.template import get_template
    from swiftlite.models.builtin import build
    from swiftlite.models.loader import load_tokenizer
    folder = build(alias)
    auto, light = load_tokenizer(folder), load_tokenizer(folder, torch_free=True)
    assert type(light).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "héllo <think> 2+2?"},
                {"role": "assistant", "content": "4, ok"}]
    for kw in ({}, {"system": "You are Swifty."}):
        a, b = get_template(None, auto, **kw), get_template(None, light, **kw)
        assert a.to_jinja() == b.to_jinja() and a.end_of_turn == b.end_of_turn
        assert list(a.stop_token_ids()) == list(b.stop_token_ids())
        assert a.encode(messages) == b.encode(messages)
    assert (auto.eos_token, auto.pad_token, auto.bos_token) == \
        (light.eos_token, light.pad_token, light.bos_token)


def test_reading_a_checkpoints_template_imports_no_torch():
    import subprocess
    import sys
    code = ("import sys; from swiftlite.inference.checkpoints import describe, training_template; "
            "training_template(describe(None, 'SmolLM2-135M-Instruct')); "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
