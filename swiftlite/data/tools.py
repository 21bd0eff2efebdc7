"""Tools and tool calls in OpenAI's shapes: checked and normalised for training, and parsed
back out of what a model generates.

  tools       [{"type": "function", "function": {"name", "description", "parameters"}}]
              (a bare {"name", ...} schema, or a JSON string of the list, is accepted)
  tool_calls  [{"type": "function", "function": {"name", "arguments": {...}}}]
              (arguments given as a JSON string are parsed: templates such as Qwen2.5's
              write them with `tojson`, which would quote a string a second time)
"""
from __future__ import annotations

import json
import re


class BadRow(ValueError):
    """A row that cannot be used; str(e) is the reason, e.kind groups counts."""

    def __init__(self, reason: str, kind: str):
        super().__init__(reason)
        self.kind = kind


def _json(value, where: str, what: str):
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise BadRow(f"{where}: {what}: not valid JSON ({e.msg} at column {e.colno})",
                         f"invalid JSON in {what}") from None
    return value


def normalize_tools(tools) -> list[dict] | None:
    if tools in (None, "", []):
        return None
    tools = _json(tools, "'tools'", "the tool list")
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list):
        raise BadRow("'tools' must be a list of function schemas", "bad tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise BadRow(f"tools[{i}] is not an object", "bad tools")
        fn = t.get("function", t) if t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRow(f"tools[{i}] has no function name (expected {{\"type\": \"function\", "
                         "\"function\": {\"name\": ..., \"parameters\": {...}}})", "bad tools")
        out.append({"type": "function", "function": fn})
    return out


def normalize_tool_calls(calls, where: str) -> list[dict]:
    calls = _json(calls, where, "the tool call")
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not calls:
        raise BadRow(f"{where}: tool calls must be a list of {{name, arguments}} objects",
                     "bad tool call")
    out = []
    for i, c in enumerate(calls):
        fn = c.get("function", c) if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRow(f"{where}: tool call {i} has no function name", "bad tool call")
        args = _json(fn.get("arguments", {}), f"{where}: tool call {i} ({fn['name']})",
                     "the arguments")
        if not isinstance(args, dict):
            raise BadRow(f"{where}: tool call {i} ({fn['name']}): arguments must be a JSON "
                         f"object, got {type(args).__name__}", "bad tool call")
        call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(c, dict) and c.get("id"):
            call["id"] = str(c["id"])
        out.append(call)
    return out


# Qwen2.5, Qwen3, Hermes and many others write a call as <tool_call>{json}</tool_call>.
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_THINK = re.compile(r"^\s*(?:<think>)?(.*?)</think>\s*", re.S)


TOOL_CALL_OPEN = "<tool_call>"  # Hermes-style calls (Qwen2.5, Qwen3): vLLM's "hermes" parser


def writes_tool_calls(template_source: str | None) -> bool:
    """Whether a chat template writes tool calls as <tool_call>{json}</tool_call> blocks."""
    return bool(template_source) and TOOL_CALL_OPEN in template_source


def parse_reply(text: str, template_source: str | None = None) -> dict:
    """{"content", "tool_calls" (OpenAI shape, arguments as JSON text), "reasoning_content"}
    of a generated reply. Tool calls are read in the syntax the model's template writes; a call
    that is not valid JSON stays in the content."""
    out = {"content": text, "tool_calls": [], "reasoning_content": None}
    if "</think>" in text and (template_source is None or "<think>" in template_source):
        m = _THINK.match(text)
        if m:
            out["reasoning_content"] = m.group(1).strip("\n")
            text = text[m.end():]
    if writes_tool_calls(template_source):
        kept, last = [], 0
        for m in _HERMES.finditer(text):
            try:
                call = json.loads(m.group(1))
            except json.JSONDecodeError:
                continue
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                continue
            args = call.get("arguments", call.get("parameters", {}))
            out["tool_calls"].append({
                "id": f"call_{len(out['tool_calls'])}", "type": "function",
                "function": {"name": call["name"], "arguments": args if isinstance(args, str)
                             else json.dumps(args, ensure_ascii=False)}})
            kept.append(text[last:m.start()])
            last = m.end()
        kept.append(text[last:])
        text = "".join(kept) if out["tool_calls"] else text
    out["content"] = text.strip() if out["tool_calls"] else text
    return out
