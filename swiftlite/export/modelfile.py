"""The Ollama Modelfile written beside a GGUF: FROM, a TEMPLATE in Ollama's Go text/template
syntax that renders what the model was trained on, a PARAMETER stop per end-of-turn text,
SYSTEM when the run had one, and the sampling defaults of the model's generation config.

Ollama renders a prompt with its own TEMPLATE, not with the GGUF's Jinja chat template, so
the TEMPLATE has to say in Go what the Jinja says. Where swiftlite knows the model's template
(a JSON template's pieces; Qwen2.5's and Qwen3's official templates, by sha256) it writes the
Go equivalent, which tests/e2e/test_export.py renders with Go's own text/template against the
Jinja rendering (system prompts, several turns, tools, tool calls, tool results, thinking).
For a template it does not know it writes no TEMPLATE and says so: Ollama then picks one from
the GGUF's chat template itself, which is better than a wrong one.

Ollama's data (ollama/template): .System, .Messages (.Role, .Content, .Thinking,
.ToolCalls with .Function.Name and .Function.Arguments), .Tools, and the `json` function. Its
JSON is Go's (compact, keys sorted); the Jinja's is Python's (", " and ": "), so tool schemas
and arguments reach the model with other spacing than in training, as with every Ollama model.
"""
from __future__ import annotations

import json
import os

from swiftlite.log import warn

# The official templates swiftlite ships (models/chat_templates/SOURCES.md), by sha256 of the
# template without swiftlite's --system prelude.
QWEN25 = {"cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f"}
QWEN3 = {"a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8",
         "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5"}  # release-time

_QWEN_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{{- range .Tools }}\n{{ json . }}\n{{- end }}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n')

# The loop both Qwen templates share: user and later system turns, tool results grouped into
# one user turn (the Jinja looks at the previous and next message; Go keeps the previous role).
_QWEN_TAIL = (
    '{{ else if eq $m.Role "tool" }}\n'
    '{{- if ne $prev "tool" }}<|im_start|>user{{ end }}\n'
    "<tool_response>\n{{ $m.Content }}\n</tool_response>\n"
    "{{- end }}\n"
    "{{- $prev = $m.Role }}\n"
    "{{- end }}\n"
    '{{- if eq $prev "tool" }}<|im_end|>\n{{ end }}\n')

_QWEN_HEAD = (
    '{{- $first := "" }}{{ if .Messages }}{{ $first = (index .Messages 0).Role }}{{ end }}\n')

_QWEN_TURNS = (
    '{{- $prev := "" }}\n'
    "{{- range $i, $m := .Messages }}\n"
    "{{- $last := eq (len (slice $.Messages $i)) 1 }}\n"
    '{{- if and (eq $prev "tool") (ne $m.Role "tool") }}<|im_end|>\n{{ end }}\n'
    '{{- if eq $m.Role "user" }}<|im_start|>user\n{{ $m.Content }}<|im_end|>\n'
    '{{ else if and (eq $m.Role "system") (ne $i 0) }}<|im_start|>system\n'
    "{{ $m.Content }}<|im_end|>\n")

GO_QWEN25 = (
    _QWEN_HEAD +
    "{{- if .Tools }}<|im_start|>system\n"
    '{{ if eq $first "system" }}{{ (index .Messages 0).Content }}{{ else }}You are Qwen, '
    "created by Alibaba Cloud. You are a helpful assistant.{{ end }}\n\n" + _QWEN_TOOLS +
    '{{ else if eq $first "system" }}<|im_start|>system\n{{ (index .Messages 0).Content }}'
    "<|im_end|>\n"
    "{{ else }}<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\n{{ end }}\n" + _QWEN_TURNS +
    '{{ else if and (eq $m.Role "assistant") (not $m.ToolCalls) }}<|im_start|>assistant\n'
    "{{ $m.Content }}<|im_end|>\n"
    '{{ else if eq $m.Role "assistant" }}<|im_start|>assistant\n'
    "{{- if $m.Content }}\n{{ $m.Content }}\n{{- end }}\n"
    "{{- range $m.ToolCalls }}\n<tool_call>\n"
    '{"name": "{{ .Function.Name }}", "arguments": {{ json .Function.Arguments }}}\n'
    "</tool_call>\n{{- end }}<|im_end|>\n" + _QWEN_TAIL +
    '{{- if ne $prev "assistant" }}<|im_start|>assistant\n{{ end }}')

# The empty think block of a reply without reasoning: when the request says think=false
# (the template's default is thinking), or, for a run trained with --enable_thinking false,
# unless the request says think=true.
_THINK_OFF_WHEN_ASKED = "{{ if and $.IsThinkSet (not $.Think) }}"
_THINK_OFF_UNLESS_ASKED = "{{ if not (and $.IsThinkSet $.Think) }}"

# Qwen3: reasoning is shown only after the last user turn (as the Jinja's last_query_index;
# a user turn that is a wrapped <tool_response> counts as a query here), and the final
# assistant turn opens a think block. Ollama's think=false is the Jinja's enable_thinking=false.
GO_QWEN3 = (
    _QWEN_HEAD +
    "{{- $lastQuery := len .Messages }}\n"
    '{{- range $i, $m := .Messages }}{{ if eq $m.Role "user" }}{{ $lastQuery = $i }}{{ end }}'
    "{{ end }}\n"
    "{{- if .Tools }}<|im_start|>system\n"
    '{{ if eq $first "system" }}{{ (index .Messages 0).Content }}\n\n{{ end }}' + _QWEN_TOOLS +
    '{{ else if eq $first "system" }}<|im_start|>system\n{{ (index .Messages 0).Content }}'
    "<|im_end|>\n{{ end }}\n" + _QWEN_TURNS +
    '{{ else if eq $m.Role "assistant" }}<|im_start|>assistant\n'
    "{{ if and (gt $i $lastQuery) (or $last $m.Thinking) }}<think>\n{{ $m.Thinking }}\n"
    "</think>\n\n{{ end }}{{ $m.Content }}\n"
    "{{- range $j, $c := $m.ToolCalls }}\n"
    "{{- if or $j $m.Content }}\n{{ end }}<tool_call>\n"
    '{"name": "{{ $c.Function.Name }}", "arguments": {{ json $c.Function.Arguments }}}\n'
    "</tool_call>\n{{- end }}<|im_end|>\n" + _QWEN_TAIL +
    '{{- if ne $prev "assistant" }}<|im_start|>assistant\n'
    + _THINK_OFF_WHEN_ASKED + "<think>\n\n</think>\n\n{{ end }}{{- end }}")


def _go_text(text: str) -> str:
    """Literal text in a Go template ("{{" would open an action)."""
    return text if "{{" not in text else "{{ " + json.dumps(text, ensure_ascii=False) + " }}"


def _piece(spec_text: str, eos: str, content: str) -> str:
    """A JSON template piece ({content}, {eos_token}) as Go template text."""
    out = []
    for i, chunk in enumerate(spec_text.replace("{eos_token}", eos).split("{content}")):
        if i:
            out.append("{{ " + content + " }}")
        out.append(_go_text(chunk))
    return "".join(out)


def go_from_pieces(spec, eos: str) -> str:
    """A JSON template (swiftlite/templates/) as a Go template: the same pieces in the same
    order (prefix, system or the template's default, the turns, the generation header)."""
    def p(name, content="$m.Content"):
        return _piece(getattr(spec, name), eos, content)
    first = "(index .Messages 0).Content"
    out = [p("prefix"),
           '{{ if and .Messages (eq (index .Messages 0).Role "system") }}' + p("system", first)]
    if spec.default_system is not None:
        out.append("{{ else }}" + _go_text(spec.system.replace("{eos_token}", eos).replace(
            "{content}", spec.default_system)))
    out += ["{{ end }}", '{{ $prev := "" }}{{ range $i, $m := .Messages }}',
            '{{ if eq $m.Role "user" }}' + p("user"),
            '{{ else if eq $m.Role "assistant" }}' + p("assistant_header") + p("assistant")
            + p("assistant_suffix"),
            '{{ else if and (eq $m.Role "system") (ne $i 0) }}' + p("system"),
            "{{ end }}{{ $prev = $m.Role }}{{ end }}",
            '{{ if ne $prev "assistant" }}' + p("assistant_header") + "{{ end }}"]
    return "".join(out)


def go_template(template) -> tuple[str | None, str]:
    """(the Go template, which family) or (None, why not)."""
    from swiftlite.data.template import ModelTemplate, fingerprint
    eos = template.tokenizer.eos_token or ""
    if isinstance(template, ModelTemplate):
        digest = fingerprint(template.model_source)
        if digest in QWEN25:
            return GO_QWEN25, "Qwen2.5 (tools, <tool_call>)"
        if digest in QWEN3 and template.enable_thinking is False:
            return (GO_QWEN3.replace(_THINK_OFF_WHEN_ASKED, _THINK_OFF_UNLESS_ASKED),
                    "Qwen3 (tools, <tool_call>, <think>; thinking off unless asked, as trained)")
        if digest in QWEN3:
            return GO_QWEN3, "Qwen3 (tools, <tool_call>, <think>)"
        if template.fast is not None and not template.supports_tools:
            return go_from_pieces(template.fast.spec, eos), f"{template.fast.name} (ChatML)"
        return None, (f"swiftlite has no Go version of this model's chat template (sha256 "
                      f"{digest[:12]}); Ollama will choose a TEMPLATE from the GGUF's chat "
                      "template itself")
    return go_from_pieces(template.spec, eos), f"{template.name} template"


def sampling_parameters(model_dir: str) -> list[tuple[str, object]]:
    """Ollama PARAMETERs from generation_config.json: its sampling settings when it samples,
    temperature 0 when it decodes greedily (as `swiftlite infer` does by default)."""
    path = os.path.join(model_dir, "generation_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            gen = json.load(f)
    except (OSError, ValueError):
        gen = {}
    if not gen.get("do_sample"):
        return [("temperature", 0)]
    out = [(name, gen[key]) for key, name in (
        ("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
        ("repetition_penalty", "repeat_penalty")) if gen.get(key) is not None]
    return out


def _quoted(text: str) -> str | None:
    if '"""' in text:
        return None
    return '"""' + text + '"""'


def write_modelfile(path: str, source: str, template, system: str | None, model_dir: str,
                    adapter: str | None = None, note: str = "") -> str:
    """Write the Modelfile at `path` (FROM `source`, ADAPTER `adapter`); returns what the
    TEMPLATE renders (a family name) or why there is none."""
    go, family = go_template(template)
    lines = [f"# Written by swiftlite export{note}. TEMPLATE: {family}.",
             f"# ollama create NAME -f {os.path.basename(path)}", f"FROM {source}"]
    if adapter:
        lines.append(f"ADAPTER {adapter}")
    if go is not None:
        quoted = _quoted(go)
        if quoted is None:  # no shipped template has '"""'; a JSON template might
            family = "none: the template holds \"\"\", which a Modelfile cannot quote"
            lines[0] = f"# Written by swiftlite export{note}. TEMPLATE: {family}."
        else:
            lines.append(f"TEMPLATE {quoted}")
    if system is not None:
        quoted = _quoted(system)
        if quoted is None:
            warn('the system prompt holds """, which a Modelfile cannot quote: no SYSTEM line')
        else:
            lines.append(f"SYSTEM {quoted}")
    for word in dict.fromkeys(w for w in template.stop_words if w):
        lines.append(f"PARAMETER stop {json.dumps(word, ensure_ascii=False)}")
    for name, value in sampling_parameters(model_dir):
        lines.append(f"PARAMETER {name} {value}")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return family
