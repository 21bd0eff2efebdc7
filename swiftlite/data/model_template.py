"""The model's own chat template (Jinja, from its tokenizer) as a swiftlite template.

Rendering is `tokenizer.apply_chat_template(..., tokenize=False)` itself, and the text is
tokenised the way apply_chat_template tokenises it (no added special tokens), so the ids equal
`apply_chat_template(messages, tools=tools)` by construction.

What is trained is found without knowing the template's syntax. For each assistant message k,
the conversation is rendered a second time with that message replaced by a plain message whose
content is a sentinel. Everything the template writes for the other messages is unchanged, so
the two texts share a prefix and a suffix, and what lies between them in the real text is
exactly what the template wrote for message k: its reasoning, content and tool calls, however
the template trims, reformats or drops them. The span then starts right after the assistant
header (the generation prompt, so a think block the template opens is trained too) and takes in
the end-of-turn token that follows. The header and end-of-turn text are found once per
template by rendering a probe conversation.
"""
from __future__ import annotations

import hashlib
import json

from swiftlite.data.template_base import ChatTemplate, TemplateRejected
from swiftlite.errors import UsageError

OWN = "model"  # --template value and args.json name for the model's own chat template
_SENTINEL = "\ue000\ue001swiftlite\ue002"  # private-use characters: in no real text
_PROBE = "\ue003probe\ue004"
THINKING_SWITCH = "enable_thinking"  # the template variable of Qwen3's thinking mode


def chat_template_text(tokenizer) -> str | None:
    """The tokenizer's chat template string (the default one of a named set), or None."""
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        t = t.get("default")
    return t or None


def fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _common_prefix(a: str, b: str) -> int:
    """Length of the common prefix, by binary search over slice comparisons (C speed)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a: str, b: str) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid:] == b[len(b) - mid:]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class ModelTemplate(ChatTemplate):
    """The template of `tokenizer.chat_template`. `fast` is a JSON template proven to render
    plain conversations (system/user/assistant text only) identically; it is used for them."""

    name = OWN

    def __init__(self, tokenizer, system: str | None = None, fast=None,
                 enable_thinking: bool | None = None):
        self.tokenizer = tokenizer
        self.source = chat_template_text(tokenizer)
        if not self.source:
            raise UsageError("the model has no chat template of its own; pass --template "
                             "(e.g. --template default for a base model).")
        self.system = system  # --system: put in where a conversation has no system message
        # A template that to_jinja() saved: the lines a run put first, and the model's own.
        *self._saved_preludes, self.model_source = _split_preludes(self.source)
        if enable_thinking is not None and THINKING_SWITCH not in self.model_source:
            raise UsageError(f"--enable_thinking {str(enable_thinking).lower()}: this model's chat "
                             f"template has no {THINKING_SWITCH} switch (Qwen3's has); leave the "
                             "flag out.")
        # --enable_thinking: passed to the template as apply_chat_template's keyword (Qwen3:
        # false puts an empty think block into the prompt, so the reply after it is trained
        # and generated without one); None leaves the template's own default.
        self.enable_thinking = enable_thinking
        self.fast = fast if enable_thinking is None else None  # proven for the default only
        self.supports_tools = "tool" in self.source
        self.header = self._generation_header()
        self.end_of_turn = self._end_of_turn()
        self.default_system = system if system is not None else self._default_system()
        self.stop_words = [self.end_of_turn] if self.end_of_turn else []

    # -- probes -----------------------------------------------------------------------------
    def _raw(self, messages, tools=None, add_generation_prompt=False) -> str:
        switch = {} if self.enable_thinking is None else {THINKING_SWITCH: self.enable_thinking}
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
                **switch)
        except Exception as e:  # jinja2's TemplateError, or a KeyError/TypeError inside it
            msg = getattr(e, "message", None) or str(e) or type(e).__name__
            raise TemplateRejected(msg) from None

    def _generation_header(self) -> str:
        user = [{"role": "user", "content": _PROBE}]
        with_prompt, without = self._raw(user, add_generation_prompt=True), self._raw(user)
        if not with_prompt.startswith(without):
            return ""
        return with_prompt[len(without):]

    def _end_of_turn(self) -> str:
        text = self._raw([{"role": "user", "content": _PROBE},
                          {"role": "assistant", "content": _SENTINEL}])
        i = text.find(_SENTINEL)
        return text[i + len(_SENTINEL):].rstrip() if i >= 0 else ""

    def _default_system(self) -> str | None:
        """The system prompt the template puts in when a conversation has none (display and
        args.json only; rendering always goes through the template itself)."""
        user = {"role": "user", "content": _PROBE}
        with_system = self._raw([{"role": "system", "content": _SENTINEL}, user])
        plain = self._raw([user])
        i = with_system.find(_SENTINEL)
        if i < 0:
            return None
        before, after = with_system[:i], with_system[i + len(_SENTINEL):]
        tail = after[:after.find(_PROBE)] if _PROBE in after else after
        if not plain.startswith(before) or tail not in plain[len(before):]:
            return None
        return plain[len(before):len(before) + plain[len(before):].find(tail)]

    # -- rendering --------------------------------------------------------------------------
    def _with_system(self, messages: list[dict]) -> list[dict]:
        if self.system is not None and (not messages or messages[0]["role"] != "system"):
            return [{"role": "system", "content": self.system}] + list(messages)
        return list(messages)

    def check_trainable(self, messages: list[dict]) -> None:
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        if self.enable_thinking is False and any(
                m["role"] == "assistant" and m.get("reasoning_content")
                for m in messages[last_user + 1:]):
            # the prompt ends with the empty think block: the reasoning would be trained after
            # a context the model never sees (earlier turns' reasoning the template drops)
            raise TemplateRejected("a reply carries reasoning_content, but with --enable_thinking "
                                   "false the model answers without thinking; drop the reasoning "
                                   "from these rows, or train without the switch")

    @staticmethod
    def _plain(messages, tools) -> bool:
        return not tools and all(
            m["role"] in ("system", "user", "assistant") and isinstance(m.get("content"), str)
            and not m.get("tool_calls") and not m.get("reasoning_content") for m in messages)

    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools=None
               ) -> tuple[str, list[tuple[int, int, int]]]:
        """The text and, for each assistant message, (start, end, message index) of what the
        template wrote for it, from its first produced character through its end-of-turn."""
        if self.fast is not None and self._plain(messages, tools):
            return self.fast.render(messages, add_generation_prompt)
        msgs = self._with_system(messages)
        shift = len(msgs) - len(messages)  # spans name indices into the caller's messages
        text = self._raw(msgs, tools, add_generation_prompt)
        spans, lo = [], 0
        for k, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            variant = self._raw(msgs[:k] + [{"role": "assistant", "content": _SENTINEL}]
                                + msgs[k + 1:], tools, add_generation_prompt)
            q = variant.find(_SENTINEL)
            if q < 0 or variant.count(_SENTINEL) != 1:
                raise TemplateRejected("swiftlite cannot tell which part of the rendered text is "
                                       f"the reply of message {k - shift}: the template does not "
                                       "write an assistant's content verbatim. Pass --template "
                                       "with a JSON template for this model.")
            start = min(_common_prefix(text, variant), q)
            end = len(text) - min(_common_suffix(text, variant), len(variant) - q - len(_SENTINEL))
            # Start right after the assistant header, so that anything the template opens the
            # reply with (e.g. "<think>\n") is trained as the model will produce it.
            if self.header and text[start - len(self.header):start] != self.header:
                h = text.rfind(self.header, lo, start)
                if h >= 0:
                    start = h + len(self.header)
            if self.end_of_turn and text.startswith(self.end_of_turn, end):
                end += len(self.end_of_turn)
            spans.append((start, end, k - shift))
            lo = end
        return text, spans

    def render_prompt(self, messages: list[dict], tools=None) -> str:
        if self.fast is not None and self._plain(messages, tools):
            return self.fast.render(messages, add_generation_prompt=True)[0]
        return self._raw(self._with_system(messages), tools, add_generation_prompt=True)

    # -- identity and export ----------------------------------------------------------------
    def fingerprint(self) -> str:
        return json.dumps([OWN, fingerprint(self.model_source), self.system, self.enable_thinking])

    def describe(self) -> str:
        thinking = ("" if self.enable_thinking is None else
                    f", {THINKING_SWITCH}={str(self.enable_thinking).lower()}")
        return (f"the model's own chat template (sha256 {fingerprint(self.model_source)[:12]}"
                f"{thinking})")

    @property
    def saved_system(self) -> str | None:
        return self.system  # None: the template's own behaviour

    def to_jinja(self) -> str:
        """The model's template byte for byte, after a first line for each setting the run
        had: with --system, that system message where a conversation has none; with
        --enable_thinking, that setting where the caller passes none (a caller's still wins)."""
        system, thinking = self._saved_preludes  # kept unless this template sets its own
        if self.system is not None:
            system = (_SYSTEM_PRELUDE + json.dumps(self.system, ensure_ascii=False)
                      + "}] + messages %}{%- endif %}")
        if self.enable_thinking is not None:
            thinking = _THINKING_PRELUDE.format(str(self.enable_thinking).lower())
        return system + thinking + self.model_source


_SYSTEM_PRELUDE = ("{%- if not messages or messages[0]['role'] != 'system' %}{%- set messages = "
                   "[{'role': 'system', 'content': ")
_THINKING_PRELUDE = ("{{%- if " + THINKING_SWITCH + " is not defined %}}{{%- set " + THINKING_SWITCH
                     + " = {} %}}{{%- endif %}}")


def _split_preludes(source: str) -> tuple[str, str, str]:
    """(system prelude, thinking prelude, the model's template) of a template that to_jinja()
    wrote; a prelude it did not write is ""."""
    def take(source: str, matches: bool) -> tuple[str, str]:
        end = source.find("{%- endif %}") + len("{%- endif %}")
        return (source[:end], source[end:]) if matches and end > len("{%- endif %}") else ("", source)
    system, source = take(source, source.startswith(_SYSTEM_PRELUDE))
    thinking, source = take(source, any(source.startswith(_THINKING_PRELUDE.format(v))
                                        for v in ("true", "false")))
    return system, thinking, source
