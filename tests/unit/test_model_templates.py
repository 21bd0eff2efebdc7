"""The model's own chat template: ids equal apply_chat_template, labels cover exactly what the
assistant produced, on the official Qwen2.5 and Qwen3 templates (real tokenizers, no mocks)."""
import hashlib
import json

import pytest
from transformers import AutoTokenizer

from swiftlite.config.constants import IGNORE_INDEX
from swiftlite.data.model_template import ModelTemplate
from swiftlite.data.template import get_template

from test_templates import CONVERSATIONS

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}


def call(name, **args):
    return {"type": "function", "function": {"name": name, "arguments": args}}


def _tc(name, args):  # how Qwen2.5 and Qwen3 write one call
    return ('<tool_call>\n{"name": "' + name + '", "arguments": '
            + json.dumps(args, ensure_ascii=False) + '}\n</tool_call>')


EOT = "<|im_end|>"
EMPTY_THINK = "<think>\n\n</think>\n\n"
# name -> (conversation, tools, trained pieces on Qwen2.5, trained pieces on Qwen3)
CASES = {
    "no system (default system)": (
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}], None,
        ["Hello!" + EOT], [EMPTY_THINK + "Hello!" + EOT]),
    "own system, two rounds": (
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"},
         {"role": "assistant", "content": "6"}], None,
        ["4" + EOT, "6" + EOT], ["4" + EOT, EMPTY_THINK + "6" + EOT]),
    "tools with several functions, one call": (
        [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "tool_calls": [call("get_weather", city="Paris")]}],
        [WEATHER, TIME],
        [_tc("get_weather", {"city": "Paris"}) + EOT],
        [EMPTY_THINK + _tc("get_weather", {"city": "Paris"}) + EOT]),
    "parallel calls, chained tool responses, final answer": (
        [{"role": "system", "content": "You plan trips."},
         {"role": "user", "content": "Weather and time in Paris?"},
         {"role": "assistant", "content": "",
          "tool_calls": [call("get_weather", city="Paris"), call("get_time", zone="CET")]},
         {"role": "tool", "content": '{"temp": 18}'}, {"role": "tool", "content": "12:00"},
         {"role": "assistant", "content": "18°C and noon."}], [WEATHER, TIME],
        [_tc("get_weather", {"city": "Paris"}) + "\n" + _tc("get_time", {"zone": "CET"}) + EOT,
         "18°C and noon." + EOT],
        [_tc("get_weather", {"city": "Paris"}) + "\n" + _tc("get_time", {"zone": "CET"}) + EOT,
         EMPTY_THINK + "18°C and noon." + EOT]),
    "content beside a tool call, then another user turn": (
        [{"role": "user", "content": "Rome?"},
         {"role": "assistant", "content": "Let me check.",
          "tool_calls": [call("get_weather", city="Rome")]},
         {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."},
         {"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "You're welcome."}],
        [WEATHER],
        ["Let me check.\n" + _tc("get_weather", {"city": "Rome"}) + EOT, "Sunny." + EOT,
         "You're welcome." + EOT],
        ["Let me check.\n" + _tc("get_weather", {"city": "Rome"}) + EOT, "Sunny." + EOT,
         EMPTY_THINK + "You're welcome." + EOT]),
    "reasoning in an earlier and the last turn": (
        [{"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4", "reasoning_content": "two and two"},
         {"role": "user", "content": "3+3?"},
         {"role": "assistant", "content": "6", "reasoning_content": "three and three"}], None,
        # Qwen2.5 does not render reasoning; Qwen3 drops it from turns before the last query.
        ["4" + EOT, "6" + EOT], ["4" + EOT, "<think>\nthree and three\n</think>\n\n6" + EOT]),
    "reasoning inline in the content": (
        [{"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"}], None,
        ["<think>\nadd\n</think>\n\n4" + EOT], ["<think>\nadd\n</think>\n\n4" + EOT]),
    "Chinese and emoji": (
        [{"role": "user", "content": "用中文说你好 🎉"}, {"role": "assistant", "content": "你好！😀👍"}],
        None, ["你好！😀👍" + EOT], [EMPTY_THINK + "你好！😀👍" + EOT]),
    "content that looks like template syntax": (
        [{"role": "user", "content": "{{ messages }} {% if x %}<|im_start|>assistant\n"},
         {"role": "assistant", "content": "{% endif %} <tool_call>not json</tool_call> ok"}],
        None, ["{% endif %} <tool_call>not json</tool_call> ok" + EOT],
        [EMPTY_THINK + "{% endif %} <tool_call>not json</tool_call> ok" + EOT]),
}


@pytest.fixture(scope="module")
def qwen_tokenizers():
    from swiftlite.models.builtin import build
    return {"qwen2.5": AutoTokenizer.from_pretrained(build("tiny-qwen2.5")),
            "qwen3": AutoTokenizer.from_pretrained(build("tiny-qwen3"))}


def trained_pieces(tok, enc) -> list[str]:
    pieces, cur = [], []
    for i, label in zip(enc["input_ids"], enc["labels"]):
        assert label in (IGNORE_INDEX, i)
        if label != IGNORE_INDEX:
            cur.append(i)
        elif cur:
            pieces.append(tok.decode(cur))
            cur = []
    return pieces + ([tok.decode(cur)] if cur else [])


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3"])
@pytest.mark.parametrize("case", list(CASES))
def test_ids_equal_apply_chat_template_and_labels_are_the_replies(qwen_tokenizers, family, case):
    tok = qwen_tokenizers[family]
    messages, tools, want25, want3 = CASES[case]
    template = get_template(None, tok)
    assert isinstance(template, ModelTemplate) and template.fast is None
    enc = template.encode(messages, tools)
    assert enc["input_ids"] == tok.apply_chat_template(messages, tools=tools)["input_ids"]
    assert trained_pieces(tok, enc) == (want25 if family == "qwen2.5" else want3)


def test_default_system_prompts_come_from_the_templates(qwen_tokenizers):
    assert get_template(None, qwen_tokenizers["qwen2.5"]).default_system == \
        "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    assert get_template(None, qwen_tokenizers["qwen3"]).default_system is None


def test_system_override_and_its_saved_template(qwen_tokenizers):
    tok = qwen_tokenizers["qwen2.5"]
    plain = get_template(None, tok)
    assert plain.to_jinja() == tok.chat_template  # byte for byte
    swifty = get_template(None, tok, system="You are Swifty.")
    msgs = CASES["no system (default system)"][0]
    text, _ = swifty.render(msgs)
    assert "You are Swifty." in text and "Alibaba" not in text
    # The saved template renders what was trained, with plain apply_chat_template.
    saved = AutoTokenizer.from_pretrained(tok.name_or_path)
    saved.chat_template = swifty.to_jinja()
    assert saved.apply_chat_template(msgs, tokenize=False) == text
    assert saved.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True) == \
        swifty.render_prompt(msgs[:1])
    # Wrapping twice (merge-lora of such a checkpoint) changes nothing.
    saved_again = get_template(None, saved, system="You are Swifty.")
    assert saved_again.to_jinja() == swifty.to_jinja()


def test_loss_flags_and_loss_scale(qwen_tokenizers):
    tok = qwen_tokenizers["qwen2.5"]
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "one", "loss": False},
            {"role": "user", "content": "b"}, {"role": "assistant", "content": "two"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "three"}]
    assert trained_pieces(tok, get_template(None, tok).encode(msgs)) == ["two" + EOT, "three" + EOT]
    last = get_template(None, tok, loss_scale="last_round")
    assert trained_pieces(tok, last.encode(msgs)) == ["three" + EOT]
    forced = [dict(m, loss=True) if m.get("content") == "one" else m for m in msgs]
    assert trained_pieces(tok, last.encode(forced)) == ["one" + EOT, "three" + EOT]
    enc = get_template(None, tok, loss_scale="all").encode(msgs)
    assert enc["labels"] == enc["input_ids"]


# A Llama-3-style template: trims content and writes its own end-of-turn text.
TRIMMING = ("{% for m in messages %}{{ '<|start|>' + m['role'] + '\n\n' + m['content'] | trim "
            "+ '<|eot|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant\n\n' }}"
            "{% endif %}")


def test_a_template_that_trims_content(qwen_tokenizers):
    tok = AutoTokenizer.from_pretrained(qwen_tokenizers["qwen2.5"].name_or_path)
    tok.chat_template = TRIMMING
    msgs = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "  Hi there \n"}]
    enc = get_template(None, tok).encode(msgs)
    assert enc["input_ids"] == tok.apply_chat_template(msgs)["input_ids"]
    assert trained_pieces(tok, enc) == ["Hi there<|eot|>"]


def test_a_template_error_is_a_rejected_row(qwen_tokenizers):
    from swiftlite.data.template import TemplateRejected
    tok = AutoTokenizer.from_pretrained(qwen_tokenizers["qwen2.5"].name_or_path)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
                         "{{ raise_exception('System message must be first') }}{% endif %}"
                         "{{ m['content'] }}{% endfor %}")
    msgs = [{"role": "user", "content": "a"}, {"role": "system", "content": "late"},
            {"role": "assistant", "content": "b"}]
    with pytest.raises(TemplateRejected, match="System message must be first"):
        get_template(None, tok).encode(msgs)


@pytest.fixture(scope="module")
def own_templates(tiny_qwen2, smollm2):
    return [AutoTokenizer.from_pretrained(tiny_qwen2), AutoTokenizer.from_pretrained(smollm2)]


def test_json_fast_path_is_proven_identical(own_templates):
    """qwen.json and smollm.json claim (in 'reproduces') to render Qwen2-Instruct's and
    SmolLM2's own templates identically: ids and labels, with and without --system."""
    for tok in own_templates:
        for system in (None, "Custom system."):
            fast = get_template(None, tok, system=system)
            assert fast.fast is not None
            assert hashlib.sha256(tok.chat_template.encode()).hexdigest() in fast.fast.spec.reproduces
            slow = ModelTemplate(tok, system=system)
            for msgs in CONVERSATIONS:
                assert fast.encode(msgs) == slow.encode(msgs)
                assert fast.render_prompt(msgs[:-1]) == slow.render_prompt(msgs[:-1])
                if system is None:
                    assert fast.encode(msgs)["input_ids"] == tok.apply_chat_template(msgs)["input_ids"]


def test_tools_need_a_template_that_renders_them(own_templates):
    from swiftlite.data.template import TemplateRejected
    msgs = CASES["tools with several functions, one call"][0]
    with pytest.raises(TemplateRejected, match="no place for tools"):
        get_template(None, own_templates[0]).encode(msgs, [WEATHER])


# -- Qwen3's thinking switch (--enable_thinking) ---------------------------------------------------
def test_thinking_off_moves_the_empty_think_block_into_the_prompt(qwen_tokenizers):
    """--enable_thinking false: the prompt ends with the empty think block (as Qwen3 is served
    without thinking), so the reply after it is trained alone; the default (thinking) trains
    the empty block as part of the reply. Ids equal apply_chat_template with the switch."""
    tok = qwen_tokenizers["qwen3"]
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    off = get_template(None, tok, enable_thinking=False)
    enc = off.encode(messages)
    assert enc["input_ids"] == tok.apply_chat_template(messages, enable_thinking=False)["input_ids"]
    assert trained_pieces(tok, enc) == ["4" + EOT]
    assert trained_pieces(tok, get_template(None, tok).encode(messages)) == [EMPTY_THINK + "4" + EOT]
    assert off.render_prompt(messages[:1]).endswith("<|im_start|>assistant\n" + EMPTY_THINK)
    assert get_template(None, tok).render_prompt(messages[:1]).endswith("<|im_start|>assistant\n")
    assert off.fingerprint() != get_template(None, tok).fingerprint()  # tokenised data differs


def test_thinking_off_refuses_replies_that_carry_reasoning(qwen_tokenizers):
    """With the switch off the prompt ends with the empty think block, so a reply's reasoning
    would be trained after a context the model never sees: such a row is rejected (counted
    under --skip_bad_rows), not trained from inside the think block."""
    from swiftlite.data.template_base import TemplateRejected
    tok = qwen_tokenizers["qwen3"]
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "2 and 2 make 4"}]
    with pytest.raises(TemplateRejected, match="--enable_thinking false"):
        get_template(None, tok, enable_thinking=False).encode(messages)
    assert trained_pieces(tok, get_template(None, tok).encode(messages))[0].startswith("<think>")


def test_the_saved_template_defaults_to_the_trained_setting(qwen_tokenizers):
    """to_jinja(): plain apply_chat_template (no keyword) renders as the run was trained; a
    caller's enable_thinking still wins; read back, the template keeps one prelude each."""
    tok = qwen_tokenizers["qwen3"]
    user = [{"role": "user", "content": "hi"}]
    off = get_template(None, tok, system="Be brief.", enable_thinking=False)
    saved = AutoTokenizer.from_pretrained(tok.name_or_path)
    saved.chat_template = off.to_jinja()
    assert saved.apply_chat_template(user, tokenize=False, add_generation_prompt=True) == \
        off.render_prompt(user)
    assert saved.apply_chat_template(user, tokenize=False, add_generation_prompt=True,
                                     enable_thinking=True) == \
        get_template(None, tok, system="Be brief.").render_prompt(user)
    again = get_template(None, saved, system="Be brief.", enable_thinking=False)
    assert again.to_jinja() == off.to_jinja() and again.model_source == off.model_source
    assert get_template(None, saved, enable_thinking=True).to_jinja().count("enable_thinking = ") == 1
    assert again.fingerprint() == off.fingerprint()


@pytest.mark.parametrize("name", [None, "chatml"])
def test_enable_thinking_on_a_template_without_the_switch_is_refused(qwen_tokenizers, name):
    from swiftlite.errors import UsageError
    with pytest.raises(UsageError, match="enable_thinking"):
        get_template(name, qwen_tokenizers["qwen2.5"], enable_thinking=False)
