"""Dataset row formats, detected per file and normalised to OpenAI-style `messages`.

  messages        {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}
  sharegpt        {"conversations": [{"from": "human"|"gpt"|"system", "value": str}, ...],
                   optional "system"}
  alpaca          {"instruction", "input" (optional), "output", "system" (optional),
                   "history" (optional [[query, response], ...])}
  query-response  {"query", "response", "system" (optional), "history" (optional)}

A row that does not fit raises BadRow with a reason; the loader adds file and line.
"""
from __future__ import annotations

import json

FORMATS = ("messages", "sharegpt", "alpaca", "query-response")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}


class BadRow(ValueError):
    """A row that cannot be used; str(e) is the reason, e.reason_kind groups counts."""

    def __init__(self, reason: str, kind: str):
        super().__init__(reason)
        self.kind = kind


def detect_format(row: dict) -> str | None:
    if not isinstance(row, dict):
        return None
    if "messages" in row:
        return "messages"
    if "conversations" in row:
        return "sharegpt"
    if "instruction" in row and "output" in row:
        return "alpaca"
    if "query" in row and "response" in row:
        return "query-response"
    return None


def to_messages(row: dict, fmt: str, *, require_reply: bool = True) -> list[dict]:
    """Normalise one row; validates roles, order and content types."""
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
            if "content" not in m or m["content"] is None:
                raise BadRow(f"messages[{i}] ({m['role']}) has no content", "missing content")
            out.append({"role": m["role"], "content": m["content"]})
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
                             "gpt or system)", "unknown role")
            value = m.get("value", m.get("content"))
            if value is None:
                raise BadRow(f"conversations[{i}] ({who}) has no value", "missing content")
            out.append({"role": role, "content": value})
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
    check_messages(out, require_reply=require_reply)
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
    """Optional system first, then user/assistant alternating from user; strings only."""
    if not msgs:
        raise BadRow("the conversation is empty", "empty conversation")
    for i, m in enumerate(msgs):
        if not isinstance(m["content"], str):
            raise BadRow(f"message {i} ({m['role']}) content must be a string, got "
                         f"{type(m['content']).__name__}", "non-string content")
        if m["role"] not in ("system", "user", "assistant"):
            raise BadRow(f"message {i} has unknown role {m['role']!r} (expected system, user "
                         "or assistant)", "unknown role")
    turns = msgs[1:] if msgs[0]["role"] == "system" else msgs
    for i, m in enumerate(turns):
        want = "user" if i % 2 == 0 else "assistant"
        if m["role"] != want:
            raise BadRow(f"wrong role order: turn {i + 1} is {m['role']!r} where {want!r} was "
                         "expected (optional system first, then user and assistant alternating)",
                         "wrong role order")
    if not turns:
        raise BadRow("the conversation has no user turn", "no user turn")
    if require_reply and turns[-1]["role"] != "assistant":
        raise BadRow("the conversation does not end with an assistant reply", "no reply")
