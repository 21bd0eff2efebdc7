"""OpenAI's chat and completions APIs: checking a request body, and the response shapes.

A bad field raises ApiError(400) naming it; what swiftlite does not do (forcing a tool call,
echo on chat) is refused by name rather than silently ignored.
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
                             404: "not_found_error", 413: "invalid_request_error",
                             429: "rate_limit_error"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


SEED_MAX = 2 ** 63 - 1  # what torch's generators take


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def sampling(body: dict, max_tokens_default: int, chat: bool = True) -> dict:
    """The generation settings of a request, checked; with its log-probability settings:
    "logprobs" (None: none; k: the chosen token's log-prob and the k most likely) and "echo"
    (completions: the prompt comes back first, with its log-probs when logprobs is set)."""
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

    logprobs, echo = logprob_settings(body, chat)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    which = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    # max_tokens 0 with echo scores the prompt and generates nothing (as vLLM allows).
    least = 0 if echo else 1
    if max_tokens is None:
        max_tokens = max_tokens_default
    elif not _integer(max_tokens) or max_tokens < least:
        raise _bad(which, f"must be a positive integer{' (or 0 with echo)' if not chat else ''}"
                          f", got {max_tokens!r}")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(
            isinstance(s, str) and s for s in stop):
        raise _bad("stop", "must be a string or a list of up to 4 non-empty strings")
    seed = body.get("seed")
    if seed is not None and (not _integer(seed) or not 0 <= seed <= SEED_MAX):
        raise _bad("seed", f"must be an integer from 0 to 2^63-1, got {seed!r}")
    if not isinstance(body.get("stream", False), bool):
        raise _bad("stream", "must be true or false")
    return {"max_tokens": max_tokens, "temperature": number("temperature", 0, 2, 1.0),
            "top_p": number("top_p", 0.0, 1.0, 1.0) or 1.0, "n": number("n", 1, 16, 1, int),
            "seed": seed, "stop": stop, "logprobs": logprobs, "echo": echo}


# The most alternatives per token: OpenAI's limits (chat's top_logprobs, the legacy logprobs).
MAX_TOP_LOGPROBS = {True: 20, False: 5}


def logprob_settings(body: dict, chat: bool) -> tuple[int | None, bool]:
    """(alternatives per token or None, echo). Chat: logprobs true/false and top_logprobs;
    completions: logprobs as the number of alternatives, and echo."""
    most = MAX_TOP_LOGPROBS[chat]
    logprobs = body.get("logprobs")
    if chat:
        if logprobs is not None and not isinstance(logprobs, bool):
            raise _bad("logprobs", f"must be true or false, got {logprobs!r}")
        top = body.get("top_logprobs")
        if top is not None:
            if not _integer(top) or not 0 <= top <= most:
                raise _bad("top_logprobs", f"must be an integer from 0 to {most}, got {top!r}")
            if not logprobs:
                raise _bad("top_logprobs", "needs logprobs: true")
        if body.get("echo"):
            raise _bad("echo", "is a /v1/completions field; chat completions do not echo")
        return (top or 0) if logprobs else None, False
    if logprobs is not None and (not _integer(logprobs) or not 0 <= logprobs <= most):
        raise _bad("logprobs", f"must be an integer from 0 to {most} (the alternatives per "
                               f"token), got {logprobs!r}")
    echo = body.get("echo", False)
    if echo is None:
        echo = False
    if not isinstance(echo, bool):
        raise _bad("echo", f"must be true or false, got {echo!r}")
    return logprobs, echo


def prompts(body: dict) -> tuple[list[str | list[int]], bool]:
    """The prompts of a completions request and whether it is a batch: a string, a list of
    token ids, or a list of either (a batch: one choice per prompt, in order)."""
    p = body.get("prompt")
    what = "must be a non-empty string, a list of token ids, or a non-empty list of either"
    batch = not (isinstance(p, str) or (isinstance(p, list) and p and all(map(_integer, p))))
    if not batch:
        p = [p]
    if not isinstance(p, list) or not p:
        raise _bad("prompt", what)
    for i, one in enumerate(p):
        if isinstance(one, list):
            if not one or not all(map(_integer, one)):
                raise _bad(f"prompt[{i}]", "must be a non-empty list of token ids")
        elif not isinstance(one, str) or not one:
            raise _bad(f"prompt[{i}]", what)
    return p, batch


def check_unicode(body: dict) -> None:
    """JSON can escape a lone UTF-16 surrogate ("\\ud800"), which is no Unicode character:
    no tokenizer or template can encode it. The client's error, named by its field."""
    found = _surrogate(body, "")
    if found:  # the path too may hold it (a key): written escaped
        where = found[0].encode("utf-8", "backslashreplace").decode() or "body"
        raise _bad(where, f"contains a lone surrogate {found[1]!r} (half of a UTF-16 pair, "
                          "not a character); send valid Unicode text")


def _surrogate(obj, path: str) -> tuple[str, str] | None:
    if isinstance(obj, str):
        if not obj.isascii():
            try:
                obj.encode("utf-8")
            except UnicodeEncodeError as e:
                return path, obj[e.start]
        return None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) \
        if isinstance(obj, list) else ()
    for k, v in items:
        where = f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}" if path else str(k)
        found = _surrogate(k, where) if isinstance(k, str) else None
        found = found or _surrogate(v, where)
        if found:
            return found
    return None


def check_ids(ids: list[int], vocab: int, param: str) -> None:
    """Token ids the model has (an id past its embedding would fail the whole batch)."""
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise _bad(param, f"token id {bad} is not in this model's vocabulary (0..{vocab - 1})")


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


def chat_chunk(rid: str, model: str, index: int, delta: dict, finish: str | None = None,
               logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model, "choices": [{"index": index, "delta": delta,
                                         "logprobs": logprobs, "finish_reason": finish}]}


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}
