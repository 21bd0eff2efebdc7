"""OpenAI's chat and completions APIs: checking a request body, and the response shapes.

A bad field raises ApiError(400) naming it; what swiftlite does not do (logprobs, echo,
forcing a tool call) is refused by name rather than silently ignored.
"""
from __future__ import annotations

import time
import uuid


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error",
                             404: "not_found_error", 429: "rate_limit_error"}.get(
            status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def sampling(body: dict, max_tokens_default: int) -> dict:
    """The generation settings of a request, checked."""
    def number(name, lo, hi, default, kind=float):
        v = body.get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (
                kind is int and not float(v).is_integer()):
            raise _bad(name, f"must be {'an integer' if kind is int else 'a number'}, got {v!r}")
        if not lo <= v <= hi:
            raise _bad(name, f"must be between {lo} and {hi}, got {v}")
        return kind(v)

    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    which = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_tokens is None:
        max_tokens = max_tokens_default
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise _bad(which, f"must be a positive integer, got {max_tokens!r}")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(
            isinstance(s, str) and s for s in stop):
        raise _bad("stop", "must be a string or a list of up to 4 non-empty strings")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad("seed", f"must be an integer, got {seed!r}")
    for name in ("logprobs", "echo"):
        if body.get(name):
            raise _bad(name, "is not supported by swiftlite deploy")
    if not isinstance(body.get("stream", False), bool):
        raise _bad("stream", "must be true or false")
    return {"max_tokens": max_tokens, "temperature": number("temperature", 0, 2, 1.0),
            "top_p": number("top_p", 0.0, 1.0, 1.0) or 1.0, "n": number("n", 1, 16, 1, int),
            "seed": seed, "stop": stop}


def chat_inputs(body: dict) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) of a chat request; tool_choice "none" leaves the tools out."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", "must be an object")
        m = dict(m)
        if isinstance(m.get("content"), list):  # content parts: text only
            parts = m["content"]
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in parts):
                raise _bad(f"messages[{i}].content", "only text parts are supported")
            m["content"] = "".join(p.get("text", "") for p in parts)
        if m.get("role") == "developer":
            m["role"] = "system"
        out.append(m)
    tools = body.get("tools") or None
    choice = body.get("tool_choice", "auto")
    if choice == "none":
        tools = None
    elif choice not in ("auto", None) and tools:
        raise _bad("tool_choice", "only 'auto' and 'none' are supported (the model decides)")
    return out, tools


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def chat_response(rid: str, model: str, choices: list[dict], usage: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage}


def chat_chunk(rid: str, model: str, index: int, delta: dict, finish: str | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model, "choices": [{"index": index, "delta": delta,
                                         "finish_reason": finish}]}


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}
