"""JSON templates: small data files in swiftlite/templates/, for models without a chat template of their
own (base models), for --template overrides, and as a fast path for model templates they are
proven to reproduce.

A template is a JSON file with the pieces of a conversation:

  prefix            once at the start (e.g. a BOS token)
  system, user      formats with {content}
  assistant_header  starts an assistant turn; also the generation prompt
  assistant         the trained part of a reply: "{content}" plus the end-of-turn token
  assistant_suffix  after the end-of-turn token, not trained (e.g. "\\n")
  default_system    used when a conversation has no system message (null: none)
  stop_words        where generation stops
  reproduces        sha256 of model chat templates this one renders identically for plain
                    conversations (system/user/assistant text); tests/unit/test_templates.py proves it

`{eos_token}` in any piece is replaced by the tokenizer's EOS token.

"""
from __future__ import annotations

import importlib.resources
import json
import os
from dataclasses import dataclass, field

from swiftlite.data.template_base import ChatTemplate, TemplateRejected
from swiftlite.errors import UsageError

_FIELDS = ("name", "prefix", "system", "user", "assistant_header", "assistant",
           "assistant_suffix", "default_system", "stop_words", "description", "reproduces")


@dataclass(frozen=True)
class TemplateSpec:
    name: str
    system: str
    user: str
    assistant_header: str
    assistant: str
    prefix: str = ""
    assistant_suffix: str = ""
    default_system: str | None = None
    stop_words: list[str] = field(default_factory=list)
    description: str = ""
    reproduces: list[str] = field(default_factory=list)


def template_names() -> list[str]:
    root = importlib.resources.files("swiftlite.templates")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


def load_spec(name_or_path: str) -> TemplateSpec:
    """A template by name (a file shipped in swiftlite/templates/) or by path to a JSON file."""
    if name_or_path.endswith(".json") or os.path.sep in name_or_path:
        if not os.path.isfile(name_or_path):
            raise UsageError(f"--template {name_or_path}: no such file.")
        text, where = open(name_or_path, encoding="utf-8").read(), name_or_path
    else:
        res = importlib.resources.files("swiftlite.templates") / f"{name_or_path}.json"
        if not res.is_file():
            raise UsageError(f"--template {name_or_path}: unknown template. Known: "
                             f"{', '.join(template_names())}; or pass a path to a JSON file.")
        text, where = res.read_text(encoding="utf-8"), f"template {name_or_path}"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{where}: not valid JSON ({e}).") from None
    unknown = set(data) - set(_FIELDS)
    missing = {"system", "user", "assistant_header", "assistant"} - set(data)
    if unknown or missing:
        raise UsageError(f"{where}: " + "; ".join(
            ([f"unknown keys {sorted(unknown)}"] if unknown else []) +
            ([f"missing keys {sorted(missing)}"] if missing else [])) +
            f". A template has the keys {', '.join(_FIELDS)}.")
    lists = ("stop_words", "reproduces")
    wrong = [f"'{k}' must be {'a list of strings' if k in lists else 'a string'}, got "
             f"{json.dumps(v, ensure_ascii=False)}" for k, v in data.items()
             if not (isinstance(v, list) and all(isinstance(w, str) for w in v) if k in lists
                     else isinstance(v, str) or (k == "default_system" and v is None))]
    if wrong:  # a string stop_words would stop at each of its characters
        raise UsageError(f"{where}: " + "; ".join(wrong) + ".")
    if "{content}" not in data["assistant"]:
        raise UsageError(f"{where}: 'assistant' must contain {{content}}.")
    data.setdefault("name", os.path.basename(name_or_path).removesuffix(".json"))
    return TemplateSpec(**data)


class Template(ChatTemplate):
    """A JSON template bound to a tokenizer. Build it with get_template()."""

    supports_tools = False

    def __init__(self, spec: TemplateSpec, tokenizer, system: str | None = None):
        eos = tokenizer.eos_token or ""
        fill = (lambda s: s.replace("{eos_token}", eos)) if eos else (lambda s: s)
        self.spec = spec
        self.name = spec.name
        self.tokenizer = tokenizer
        self._p = {k: fill(getattr(spec, k)) for k in
                   ("prefix", "system", "user", "assistant_header", "assistant", "assistant_suffix")}
        # `--system` replaces the template's default; a conversation's own system message wins.
        self.default_system = system if system is not None else spec.default_system
        self.stop_words = [fill(w) for w in spec.stop_words]
        end = self._p["assistant"].split("{content}", 1)[1]
        self.end_of_turn = end  # e.g. "<|im_end|>": trained after every reply

    def describe(self) -> str:
        return f"{self.name} template"

    def fingerprint(self) -> str:
        return json.dumps([self.spec.__dict__, self.default_system], sort_keys=True, default=list)

    # -- rendering ------------------------------------------------------------------------
    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools=None
               ) -> tuple[str, list[tuple[int, int, int]]]:
        """The prompt string and (start, end, message index) of each assistant reply."""
        p = self._p
        parts, spans, pos = [p["prefix"]], [], len(p["prefix"])

        def put(text: str, index: int | None = None):
            nonlocal pos
            if index is not None:
                spans.append((pos, pos + len(text), index))
            parts.append(text)
            pos += len(text)

        first = 0
        if messages and messages[0]["role"] == "system":
            put(p["system"].replace("{content}", messages[0]["content"]))
            first = 1
        elif self.default_system is not None:
            put(p["system"].replace("{content}", self.default_system))
        for k in range(first, len(messages)):
            m = messages[k]
            if m["role"] == "user":
                put(p["user"].replace("{content}", m["content"]))
            elif m["role"] == "assistant":
                put(p["assistant_header"])
                put(p["assistant"].replace("{content}", m["content"]), index=k)
                put(p["assistant_suffix"])
            else:
                raise TemplateRejected(f"it has no place for the role {m['role']!r} (only "
                                       "system, user, assistant)")
        if add_generation_prompt:
            put(p["assistant_header"])
        return "".join(parts), spans

    def render_prompt(self, messages: list[dict], tools=None) -> str:
        return self.render(messages, add_generation_prompt=True)[0]

    # -- export ---------------------------------------------------------------------------
    def to_jinja(self) -> str:
        """An equivalent Jinja chat template, written into saved tokenizers so that plain
        `apply_chat_template` renders exactly what swiftlite trained on."""
        p = {k: self.spec.__dict__[k] for k in self._p}

        def lit(s: str) -> str:  # a Jinja expression for a piece, with {content}/{eos_token}
            out = []
            for i, chunk in enumerate(s.split("{content}")):
                if i:
                    out.append("content")
                pieces = chunk.split("{eos_token}")
                for k, piece in enumerate(pieces):
                    if k:
                        out.append("eos_token")
                    if piece:
                        out.append(json.dumps(piece, ensure_ascii=False))
            return "{{ " + " + ".join(out) + " }}" if out else ""

        default = ("{%- set system = " + json.dumps(self.default_system, ensure_ascii=False) + " %}"
                   if self.default_system is not None else "{%- set system = none %}")
        return (
            "{%- set msgs = messages %}" + default +
            "{%- if messages and messages[0]['role'] == 'system' %}"
            "{%- set system = messages[0]['content'] %}{%- set msgs = messages[1:] %}{%- endif %}"
            + lit(p["prefix"]) +
            "{%- if system is not none %}{%- set content = system %}" + lit(p["system"]) +
            "{%- endif %}"
            "{%- for message in msgs %}{%- set content = message['content'] %}"
            "{%- if message['role'] == 'user' %}" + lit(p["user"]) +
            "{%- elif message['role'] == 'assistant' %}" + lit(p["assistant_header"])
            + lit(p["assistant"]) + lit(p["assistant_suffix"]) +
            "{%- endif %}{%- endfor %}"
            "{%- if add_generation_prompt %}" + lit(p["assistant_header"]) + "{%- endif %}")


