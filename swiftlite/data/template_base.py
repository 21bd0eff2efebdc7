"""What every chat template does with its rendering: token ids and labels, prompts, stops.

Two kinds of template render conversations (json_template: small data files in swiftlite/templates/;
model_template: the model's own Jinja template). Both render the whole conversation to one
string with the character span of each assistant reply, and this module tokenises that string
once and sets labels from the spans (offset mapping). Tokenising the whole string, not piece
by piece, is what makes the ids identical to `tokenizer.apply_chat_template`.
"""
from __future__ import annotations

from bisect import bisect_left

from swiftlite.config.constants import IGNORE_INDEX
from swiftlite.errors import UsageError


class TemplateRejected(ValueError):
    """A template cannot render a conversation (its own raise_exception, or a role or tool
    call it has no syntax for). str(e) is the reason, without naming the template: the caller
    does."""

_FIELDS = ("name", "prefix", "system", "user", "assistant_header", "assistant",
           "assistant_suffix", "default_system", "stop_words", "description")


LOSS_SCALES = ("default", "last_round", "all")


class ChatTemplate:
    """What every template does with its render(): token ids and labels, prompts, stops.

    A subclass sets name, tokenizer, default_system, stop_words, end_of_turn, supports_tools
    and implements render(messages, add_generation_prompt, tools) -> (text, spans), with one
    (start, end, message index) span per assistant message, and render_prompt(messages, tools).
    """

    loss_scale = "default"
    enable_thinking = None  # the thinking switch of a model's own template (ModelTemplate)

    @property
    def saved_system(self) -> str | None:
        """The system prompt to write into args.json / swiftlite.json, so that get_template with
        it rebuilds this template."""
        return self.default_system

    def encode(self, messages: list[dict], tools=None) -> dict:
        """{'input_ids', 'labels'} for one conversation; labels are -100 outside what is
        trained (the assistant's replies, by default)."""
        out = self.encode_batch([{"messages": messages, "tools": tools}])[0]
        if isinstance(out, Exception):
            raise out
        return out

    def encode_batch(self, conversations: list) -> list:
        """encode() for many conversations ({'messages', 'tools'} dicts or message lists), one
        tokenizer call for all. A conversation the template rejects gives its exception."""
        rendered = []
        for c in conversations:
            msgs, tools = (c["messages"], c.get("tools")) if isinstance(c, dict) else (c, None)
            try:
                self.check_renderable(msgs, tools)
                self.check_trainable(msgs)
                text, spans = self.render(msgs, tools=tools)
                rendered.append((text, trained_spans(spans, msgs, self.loss_scale)))
            except (TemplateRejected, UsageError) as e:
                rendered.append(e)
        tokenised = iter(self._tokenise([r[0] for r in rendered if not isinstance(r, Exception)]))
        out = []
        for r in rendered:
            if isinstance(r, Exception):
                out.append(r)
                continue
            ids, offsets = next(tokenised)
            out.append({"input_ids": ids, "labels": list(ids) if r[1] is None  # --loss_scale all
                        else _labels(ids, offsets, r[1])})
        return out

    def encode_replies(self, conversations: list[dict]) -> list:
        """Preference training: for each {"messages": prompt, "tools"?, "replies": [assistant
        messages]}, {"prompt_ids", "replies": [{"input_ids", "labels"}, ...]} or the exception
        that rejects it. The prompt is rendered once with the generation header and tokenised
        alone, and each reply is the template's rendering of prompt + reply minus that prompt,
        tokenised alone: every reply continues the very ids the model sees when it is asked
        to answer (no BPE merge across the boundary), and its labels are what the template
        trains of that reply (its content, tool calls, reasoning, end of turn)."""
        texts, layout, out = [], [], []
        for c in conversations:
            prompt, tools = c["messages"], c.get("tools")
            try:
                self.check_renderable(prompt + c["replies"], tools)
                self.check_trainable(prompt + c["replies"])
                prompt_text = self.render_prompt(prompt, tools=tools)
                pieces = []
                for reply in c["replies"]:
                    text, spans = self.render(prompt + [reply], tools=tools)
                    if not text.startswith(prompt_text):
                        raise TemplateRejected(
                            "the template renders the prompt differently once a reply follows "
                            "it, so a reply cannot continue the prompt's tokens")
                    n = len(prompt_text)
                    pieces.append((text[n:], [(max(a - n, 0), b - n) for a, b, k in spans
                                              if k == len(prompt) and b > n]))
            except (TemplateRejected, UsageError) as e:
                out.append(e)
                continue
            layout.append(pieces)
            texts += [prompt_text] + [t for t, _ in pieces]
            out.append(None)
        tokenised = iter(self._tokenise(texts))
        layouts = iter(layout)
        for i, r in enumerate(out):
            if r is not None:
                continue
            prompt_ids = next(tokenised)[0]
            replies = []
            for _, spans in next(layouts):
                ids, offsets = next(tokenised)
                replies.append({"input_ids": ids, "labels": _labels(ids, offsets, spans)})
            out[i] = {"prompt_ids": prompt_ids, "replies": replies}
        return out

    def _tokenise(self, texts: list[str]) -> list[tuple[list[int], list]]:
        """(ids, character offsets) of each text. A fast tokenizer's Rust half is called
        directly when it has no truncation or padding set (what transformers' call does then,
        less a Python conversion per text that cost a tenth of encoding)."""
        if not texts:
            return []
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and backend.truncation is None and backend.padding is None:
            return [(e.ids, e.offsets) for e in backend.encode_batch(texts, add_special_tokens=False)]
        enc = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        return list(zip(enc["input_ids"], enc["offset_mapping"]))

    def check_renderable(self, messages: list[dict], tools) -> None:
        if (tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)) \
                and not self.supports_tools:
            raise TemplateRejected("it has no place for tools, tool calls or tool messages; "
                                   "use a model whose own chat template does (e.g. "
                                   "Qwen2.5-Instruct, Qwen3) or a --template that does")

    def reply_opening(self, messages: list[dict], tools=None) -> str:
        """What the template writes at the start of a reply to `messages`, before its content
        (Qwen3: "<think>\n\n</think>\n\n"; most templates: nothing): the rendering with a
        reply, between the prompt and the reply's text."""
        mark = "\u2063swiftlite-reply\u2063"
        try:
            text, _ = self.render(messages + [{"role": "assistant", "content": mark}],
                                  tools=tools)
            prompt = self.render_prompt(messages, tools=tools)
        except TemplateRejected:
            return ""
        i = text.find(mark)
        return text[len(prompt):i] if i >= len(prompt) and text.startswith(prompt) else ""

    def check_trainable(self, messages: list[dict]) -> None:
        """Raise TemplateRejected for a conversation this template renders but cannot train
        as the model will be used (ModelTemplate: reasoning with Qwen3's thinking off)."""

    def encode_prompt(self, messages: list[dict], tools=None) -> list[int]:
        """Token ids of a conversation ending with a user (or tool) turn, plus the generation
        prompt."""
        self.check_renderable(messages, tools)
        text = self.render_prompt(messages, tools=tools)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def stop_token_ids(self) -> list[int]:
        """Single-token stop words (end-of-turn, EOS) for generate()'s eos_token_id."""
        ids = []
        for w in self.stop_words + [self.tokenizer.eos_token or ""]:
            t = self.tokenizer(w, add_special_tokens=False)["input_ids"] if w else []
            if len(t) == 1 and t[0] not in ids:
                ids.append(t[0])
        return ids


def _labels(ids: list[int], offsets: list, spans: list[tuple[int, int]]) -> list[int]:
    """The labels of a tokenised text: a token is trained when it starts inside a trained
    character span and is not empty. Token starts never decrease, so each span's tokens are
    one slice, found by bisection rather than a Python step per token."""
    starts = [o[0] for o in offsets]
    labels = [IGNORE_INDEX] * len(ids)
    for start, end in spans:
        i, j = bisect_left(starts, start), bisect_left(starts, end)
        labels[i:j] = ids[i:j]
        for k in range(i, j):  # rare: a token that covers no characters is never trained
            if offsets[k][1] <= offsets[k][0]:
                labels[k] = IGNORE_INDEX
    return labels


def trained_spans(spans: list[tuple[int, int, int]], messages: list[dict], loss_scale: str):
    """The spans to train: every reply (default), the last one (last_round), or None for every
    token (all). A message's own "loss": true|false decides for that message."""
    if loss_scale == "all":
        return None
    last = max((k for _, _, k in spans), default=-1)
    keep = []
    for start, end, k in spans:
        own = messages[k].get("loss") if 0 <= k < len(messages) else None
        if own is True or (own is None and (loss_scale == "default" or k == last)):
            keep.append((start, end))
    return keep


