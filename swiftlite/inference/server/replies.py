"""A request's answer from its jobs' events (what the scheduler emits into each job's queue):
waited for whole (non-streaming; a task watches the connection and cancels the jobs the moment
the client leaves, as vLLM's server does) or streamed as server-sent events.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from swiftlite.data.tools import TOOL_CALL_OPEN
from swiftlite.inference.server import logprobs as lp
from swiftlite.inference.server import openai_api as api


@dataclass
class Outcome:
    """What one job said: its text, its "done" payload, and its log-probs when asked."""
    text: str = ""
    done: dict = field(default_factory=dict)
    tokens: list = field(default_factory=list)  # scheduler.TokenLogprob per generated token
    prompt: list | None = None  # per prompt token, when the job scored its prompt


class JobFailed(Exception):
    """The scheduler answered "error" for this job."""


class ClientGone(Exception):
    pass


async def events(q: asyncio.Queue):
    """One job's events, in order, up to its "done" (included). Its "error" raises JobFailed;
    a client that left (the watcher's "gone") raises ClientGone."""
    while True:
        kind, payload = await q.get()
        if kind == "error":
            raise JobFailed(payload)
        if kind == "gone":
            raise ClientGone()
        yield kind, payload
        if kind == "done":
            return


async def _watch(request, pairs) -> None:
    """Wait for the client to leave, then cancel its jobs and wake whoever waits for them
    (jobs still queued are never answered by the scheduler). The body has been read, so the
    next message of this request is its disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for job, q in pairs:
        job.cancelled.set()
        q.put_nowait(("gone", None))


async def finish_all(request, pairs) -> list[Outcome]:
    """Every job's outcome, in order; a client that leaves cancels its jobs at once."""
    watcher = asyncio.create_task(_watch(request, pairs))
    try:
        results = []
        for _, q in pairs:
            o = Outcome()
            async for kind, payload in events(q):
                if kind == "delta":
                    o.text += payload
                elif kind == "token":
                    o.tokens.append(payload)
                elif kind == "prompt":
                    o.prompt = payload
                else:
                    o.done = payload
            results.append(o)
        return results
    except JobFailed as e:
        raise api.ApiError(500, str(e)) from None
    except ClientGone:  # nobody reads this answer
        raise api.ApiError(499, "the client closed the connection") from None
    finally:
        watcher.cancel()
        for job, _ in pairs:
            job.cancelled.set()


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def chat_stream(d, rid: str, name: str, pairs, prompt_tokens: int, parse: bool,
                      include_usage: bool, want_lp: bool):
    """Chat chunks: each choice's text as it grows (held back while it may be a tool call,
    which is sent parsed at the end), with the log-probs of the tokens since the last chunk."""
    completion = 0
    try:
        for k in range(len(pairs)):
            yield sse(api.chat_chunk(rid, name, k, {"role": "assistant", "content": ""}))
        # Choices stream one after the other (n > 1 is rare; each is generated in parallel).
        for k, (_, q) in enumerate(pairs):
            text, held, pending = "", "", []
            async for kind, payload in events(q):
                if kind == "token":
                    pending.append(payload)
                    continue
                if kind == "delta":
                    text += payload
                    if parse and (TOOL_CALL_OPEN in text or _partial_open(text)):
                        held += payload  # maybe a tool call: decided at the end
                        continue
                    piece, held = held + payload, ""
                    yield _chat_sse(d, rid, name, k, {"content": piece}, pending, want_lp)
                    continue
                completion += payload["completion_tokens"]
                finish = payload["finish_reason"]
                reply = d.engine.parse(text) if parse else {"tool_calls": []}
                if reply["tool_calls"]:
                    before = text[:len(text) - len(held)]
                    rest = reply["content"][len(before.strip()):] if reply["content"] else ""
                    if rest.strip():
                        yield _chat_sse(d, rid, name, k, {"content": rest}, pending, want_lp)
                    yield _chat_sse(d, rid, name, k, {"tool_calls": [
                        {"index": i, **c} for i, c in enumerate(reply["tool_calls"])]},
                        pending, want_lp)
                    finish = "tool_calls"
                elif held:
                    yield _chat_sse(d, rid, name, k, {"content": held}, pending, want_lp)
                yield _chat_sse(d, rid, name, k, {}, pending, want_lp, finish)
        if include_usage:
            yield sse({"id": rid, "object": "chat.completion.chunk",
                       "created": int(time.time()), "model": name, "choices": [],
                       "usage": api.usage(prompt_tokens, completion)})
        yield "data: [DONE]\n\n"
    except JobFailed as e:
        yield sse(api.ApiError(500, str(e)).body())
    finally:  # also when the client disconnects mid-stream
        for job, _ in pairs:
            job.cancelled.set()


def _chat_sse(d, rid, name, k, delta, pending: list, want_lp, finish=None) -> str:
    """One chunk, carrying the log-probs of the tokens pending since the last (emptied)."""
    logprobs = lp.chat(pending, d.tokens) if want_lp and pending else None
    pending.clear()
    return sse(api.chat_chunk(rid, name, k, delta, finish, logprobs))


def _partial_open(text: str) -> bool:
    """The text ends with the start of "<tool_call>" (hold it back until we know)."""
    return any(text.endswith(TOOL_CALL_OPEN[:n]) for n in range(1, len(TOOL_CALL_OPEN)))


def completion_object(rid: str, name: str, choices: list, usage: dict | None = None) -> dict:
    out = {"id": rid, "object": "text_completion", "created": int(time.time()),
           "model": name, "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


async def completion_stream(d, rid: str, name: str, pairs, echoed: list[str], n: int,
                            echo: bool, want_lp: bool):
    """Completion chunks, choice after choice (n per prompt); with echo, each choice's prompt
    first, with its log-probs when asked (scored by the prompt's first choice's job)."""
    scored = {}  # prompt -> its log-probs
    try:
        for c, (job, q) in enumerate(pairs):
            i, cursor, pending = c // n, [0], []
            if echo and not job.prompt_logprobs:
                yield _completion_sse(d, rid, name, c, echoed[i], scored.get(i), cursor,
                                      want_lp)
            async for kind, payload in events(q):
                if kind == "prompt":
                    scored[i] = payload
                    yield _completion_sse(d, rid, name, c, echoed[i], payload, cursor, want_lp)
                elif kind == "token":
                    pending.append(payload)
                elif kind == "delta":
                    yield _completion_sse(d, rid, name, c, payload, pending, cursor, want_lp)
                    pending = []
                else:
                    yield _completion_sse(d, rid, name, c, "", pending, cursor, want_lp,
                                          payload["finish_reason"])
        yield "data: [DONE]\n\n"
    except JobFailed as e:
        yield sse(api.ApiError(500, str(e)).body())
    finally:
        for job, _ in pairs:
            job.cancelled.set()


def _completion_sse(d, rid, name, c, text, entries, cursor: list, want_lp, finish=None) -> str:
    """cursor[0]: the choice's text offset so far (legacy log-probs count it)."""
    logprobs = None
    if want_lp and entries:
        logprobs, cursor[0] = lp.legacy(entries, d.tokens, cursor[0])
    return sse(completion_object(rid, name, [{"index": c, "text": text, "logprobs": logprobs,
                                              "finish_reason": finish}]))
