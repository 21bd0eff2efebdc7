"""Dataset row formats, detected per file and normalised to OpenAI-style conversations:
{"messages": [...], "tools": [...] (only when the row has tools)}.

  messages        {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str,
                   "tool_calls": [...], "reasoning_content": str, "loss": bool}, ...],
                   optional "tools", "system"}; OpenAI's "weight": 0|1 for "loss";
                   ms-swift's "tool_call"/"tool_response" roles too
  sharegpt        {"conversations": [{"from": "human"|"gpt"|"system"|"function_call"|
                   "observation", "value": str}, ...], optional "system", "tools"}
  alpaca          {"instruction", "input" (optional), "output", "system" (optional),
                   "history" (optional [[query, response], ...])}
  query-response  {"query", "response", "system" (optional), "history" (optional)}

Tools, tool calls and tool messages take the shapes OpenAI's chat API uses (see data/tools.py).
A row that does not fit raises BadRow with a reason; the loader adds file and line.
"""
from __future__ import annotations

import json

from swiftlite.data.tools import BadRow, normalize_tool_calls, normalize_tools

FORMATS = ("messages", "sharegpt", "alpaca", "query-response")
ROLES = ("system", "user", "assistant", "tool")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
                   "function_call": "tool_call", "tool_call": "tool_call",
                   "observation": "tool", "tool": "tool", "tool_response": "tool"}
_MESSAGE_KEYS = ("role", "content", "tool_calls", "reasoning_content", "loss", "weight", "name",
                 "tool_call_id")

__all__ = ["BadRow", "FORMATS", "detect_format", "to_conversation", "to_messages",
           "check_messages"]


def detect_format(row: dict, require_reply: bool = True) -> str | None:
    """The format of a row; without require_reply (prompts to answer, e.g. `infer
    --val_dataset`) alpaca and query-response rows need no reply column."""
    if not isinstance(row, dict):
        return None
    if "messages" in row:
        return "messages"
    if "conversations" in row:
        return "sharegpt"
    if "instruction" in row and ("output" in row or not require_reply):
        return "alpaca"
    if "query" in row and ("response" in row or not require_reply):
        return "query-response"
    return None


def to_messages(row: dict, fmt: str, *, require_reply: bool = True) -> list[dict]:
    """The messages of one row (see to_conversation)."""
    return to_conversation(row, fmt, require_reply=require_reply)["messages"]


def to_conversation(row: dict, fmt: str, *, require_reply: bool = True) -> dict:
    """Normalise one row to {"messages", "tools"?}; validates roles, order and content."""
    if not isinstance(row, dict):
        raise BadRow(f"expected a JSON object, got {type(row).__name__}", "not an object")
    if fmt == "messages":
        msgs = row.get("messages")
        if not isinstance(msgs, list):
            raise BadRow("'messages' must be a list of {role, content} objects", "unknown format")
        out = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or "role" not in m:
                raise BadRow(f"messages[{i}] has no 'role'", "missing role")
            out.append(_message(m, i, f"messages[{i}]"))
        if row.get("system"):  # beside the messages, as other tools export it
            if out and out[0]["role"] == "system":
                raise BadRow("two system prompts: a top-level 'system' and a system message "
                             "first in 'messages'; keep one", "two system prompts")
            out.insert(0, {"role": "system", "content": row["system"]})
    elif fmt == "sharegpt":
        convs = row.get("conversations")
        if not isinstance(convs, list):
            raise BadRow("'conversations' must be a list of {from, value} objects", "unknown format")
        out = []
        if row.get("system"):
            out.append({"role": "system", "content": row["system"]})
        for i, m in enumerate(convs):
            if not isinstance(m, dict):
                raise BadRow(f"conversations[{i}] is not an object", "unknown format")
            who = m.get("from", m.get("role"))
            role = _SHAREGPT_ROLES.get(str(who).lower()) if who is not None else None
            if role is None:
                raise BadRow(f"conversations[{i}] has unknown speaker {who!r} (expected human, "
                             "gpt, system, function_call or observation)", "unknown role")
            out.append(_message({**m, "role": role, "content": m.get("value", m.get("content"))},
                                i, f"conversations[{i}] ({who})"))
    elif fmt in ("alpaca", "query-response"):
        if fmt == "alpaca":
            query, reply = row.get("instruction"), row.get("output")
            extra = row.get("input")
            if isinstance(query, str) and isinstance(extra, str) and extra:
                query = f"{query}\n{extra}"
            names = ("instruction", "output")
        else:
            query, reply, names = row.get("query"), row.get("response"), ("query", "response")
        out = []
        if row.get("system"):
            out.append({"role": "system", "content": row["system"]})
        out += _history(row.get("history"))
        if query is None:
            raise BadRow(f"'{names[0]}' is missing", "missing content")
        out.append({"role": "user", "content": query})
        if reply is not None:
            out.append({"role": "assistant", "content": reply})
        elif require_reply:
            raise BadRow(f"'{names[1]}' is missing", "missing content")
    else:
        raise BadRow(f"unknown format {fmt!r}", "unknown format")
    out = _merge_tool_calls(out)
    check_messages(out, require_reply=require_reply)
    conv = {"messages": out}
    tools = normalize_tools(row.get("tools"))
    if tools:
        conv["tools"] = tools
    return conv


def _message(m: dict, i: int, where: str) -> dict:
    """One message with only the keys a template reads, each checked."""
    role, content = m["role"], m.get("content")
    if role in ("tool_call", "function_call"):  # ms-swift / LLaMA-Factory: the call as JSON text
        return {"role": "tool_call", "tool_calls": normalize_tool_calls(content, where)}
    if role in ("tool_response", "observation"):
        role = "tool"
    out = {"role": role}
    calls = m.get("tool_calls") if role == "assistant" else None
    if calls:
        out["tool_calls"] = normalize_tool_calls(calls, where)
    if content is None:
        if not calls:
            raise BadRow(f"{where} has no content", "missing content")
        content = ""
    if role == "tool" and isinstance(content, (dict, list)):
        content = json.dumps(content, ensure_ascii=False)  # a tool's structured result
    out["content"] = content
    for key in ("reasoning_content", "name", "tool_call_id"):
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise BadRow(f"{where}: '{key}' must be a string", f"non-string {key}")
            out[key] = m[key]
    loss = _loss(m, where)
    if loss is not None:
        if role != "assistant":
            raise BadRow(f"{where}: 'loss' (OpenAI's 'weight') is only for assistant messages "
                         f"(the {role} message is never trained)", "bad loss")
        out["loss"] = loss
    return out


def _loss(m: dict, where: str) -> bool | None:
    """Whether an assistant message is trained, from swiftlite's `loss` (true/false) or OpenAI's
    `weight` (1/0); None when the message says neither."""
    loss = m.get("loss")
    if loss is not None and not isinstance(loss, bool):
        raise BadRow(f"{where}: 'loss' must be true or false, got {loss!r}", "bad loss")
    weight = m.get("weight")
    if weight is None:
        return loss
    if isinstance(weight, bool) or weight not in (0, 1):
        raise BadRow(f"{where}: 'weight' (OpenAI's fine-tuning format) is 0 or 1, got "
                     f"{weight!r}", "bad loss")
    if loss is not None and loss != bool(weight):
        raise BadRow(f"{where}: 'loss' {str(loss).lower()} and 'weight' {weight} disagree; "
                     "keep one", "bad loss")
    return bool(weight)


def _merge_tool_calls(msgs: list[dict]) -> list[dict]:
    """ms-swift's tool_call messages (LLaMA-Factory's function_call turns) become the
    tool_calls of an assistant message: the one just before, or a new one."""
    out = []
    for m in msgs:
        if m["role"] != "tool_call":
            out.append(m)
        elif out and out[-1]["role"] == "assistant":
            prev = out[-1] = dict(out[-1])
            prev["tool_calls"] = prev.get("tool_calls", []) + m["tool_calls"]
        else:
            out.append({"role": "assistant", "content": "", "tool_calls": m["tool_calls"]})
    return out


def _history(history) -> list[dict]:
    if history in (None, "", []):
        return []
    if isinstance(history, str):  # CSV cells hold JSON text
        try:
            history = json.loads(history)
        except json.JSONDecodeError:
            raise BadRow("'history' is not valid JSON", "bad history") from None
    if not isinstance(history, list) or not all(
            isinstance(h, (list, tuple)) and len(h) == 2 for h in history):
        raise BadRow("'history' must be a list of [query, response] pairs", "bad history")
    out = []
    for q, r in history:
        out += [{"role": "user", "content": q}, {"role": "assistant", "content": r}]
    return out


def check_messages(msgs: list[dict], *, require_reply: bool = True) -> None:
    """Optional system first, then turns from a user: a user is answered by the assistant; an
    assistant that calls tools is followed by their tool messages, and those by the assistant.
    Contents are strings."""
    if not msgs:
        raise BadRow("the conversation is empty", "empty conversation")
    for i, m in enumerate(msgs):
        if m["role"] not in ROLES:
            raise BadRow(f"message {i} has unknown role {m['role']!r} (expected system, user, "
                         "assistant or tool)", "unknown role")
        if not isinstance(m.get("content"), str):
            raise BadRow(f"message {i} ({m['role']}) content must be a string, got "
                         f"{type(m.get('content')).__name__}", "non-string content")
    first = 1 if msgs[0]["role"] == "system" else 0
    turns = msgs[first:]
    if not turns:
        raise BadRow("the conversation has no user turn", "no user turn")
    prev = None
    for i, m in enumerate(turns, first):
        role = m["role"]
        if prev is None:
            ok, want = role == "user", "'user'"
        elif prev["role"] == "user":
            ok, want = role == "assistant", "'assistant'"
        elif prev["role"] == "assistant":
            calls = bool(prev.get("tool_calls"))
            ok, want = (role == "tool", "'tool' (the results of its tool calls)") if calls else \
                (role == "user", "'user'")
        else:  # a tool message
            ok, want = role in ("tool", "assistant"), "'tool' or 'assistant'"
        if not ok:
            if role == "tool":
                raise BadRow(f"message {i} is a tool message, but it does not follow an "
                             "assistant turn with tool calls", "tool message without a call")
            raise BadRow(f"wrong role order: message {i} is {role!r} where {want} was expected "
                         "(optional system first, then user and assistant alternating; tool "
                         "messages after an assistant's tool calls)", "wrong role order")
        prev = m
    if require_reply and turns[-1]["role"] != "assistant":
        raise BadRow("the conversation does not end with an assistant reply", "no reply")
    for i, m in enumerate(msgs):  # e.g. an empty CSV cell: it would teach stopping at once
        if (require_reply and m["role"] == "assistant" and m.get("loss") is not False
                and not m["content"].strip() and not m.get("tool_calls")
                and not m.get("reasoning_content")):
            raise BadRow(f"message {i} (assistant) is empty: trained, it would teach the model to "
                         "end its turn at once (write the reply, or mark it \"loss\": false)",
                         "empty reply")
