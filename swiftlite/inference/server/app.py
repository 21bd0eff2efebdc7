"""The FastAPI application of `swiftlite deploy`: OpenAI's /v1/models, /v1/chat/completions
and /v1/completions over one loaded engine (a base model and its named LoRA adapters).

Every error is answered in OpenAI's shape with its status (400 bad request, 401 key, 404
model or route, 413 body over --max_request_size, 429 queue full, 500 with no traceback); the
API key is compared in constant time and never logged. No request can hold the event loop: a
body is read up to its cap, text is tokenised in a worker thread, and a prompt longer (in
characters) than any context could hold is refused before it is tokenised. A request's
answer is put together by `replies` from what the scheduler emits for its jobs; log-probs
are shaped by `logprobs`.
"""
import asyncio
import hmac
import json
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from swiftlite.data.tools import writes_tool_calls
from swiftlite.errors import UsageError
from swiftlite.inference.server import logprobs as lp
from swiftlite.inference.server import openai_api as api
from swiftlite.inference.server import replies
from swiftlite.inference.server.scheduler import Job, QueueFull, Scheduler

MAX_REQUEST_BYTES = 4 * 2 ** 20  # --max_request_size's default


@dataclass
class Deployment:
    """What the handlers share, kept on app.state.deployment."""
    engine: object
    served: dict  # model name -> adapter name (None: the base model)
    scheduler: Scheduler
    api_key: str | None
    max_queue_size: int
    max_request_bytes: int
    created: int
    max_len: int | None  # the model's context, when its config says
    tool_syntax: bool  # the template writes tool calls the engine can parse
    vocab: int  # the model's embedding rows: prompt token ids must be below
    tokens: lp.TokenText  # token ids -> their text and bytes, for log-probs
    # More characters than max_len tokens can hold (None: no max_len): the longest token's
    # characters, times 4 for what Unicode normalisation may fold into one.
    max_chars: int | None = None


def create_app(engine, served: dict[str, str | None], *, api_key: str | None = None,
               max_batch_size: int = 8, max_queue_size: int = 64,
               max_request_bytes: int = MAX_REQUEST_BYTES):
    """served: model name -> adapter name (None: the base model)."""
    app = FastAPI(title="swiftlite deploy", docs_url=None, redoc_url=None, openapi_url=None)
    scheduler = Scheduler(engine, max_batch_size=max_batch_size, max_queue_size=max_queue_size)
    max_len = int(getattr(engine.model.config, "max_position_embeddings", 0) or 0) or None
    longest = max(map(len, engine.tokenizer.get_vocab()), default=1)
    app.state.scheduler = scheduler
    app.state.deployment = Deployment(
        engine, served, scheduler, api_key, max_queue_size, max_request_bytes,
        int(time.time()), max_len, writes_tool_calls(getattr(engine.template, "source", None)),
        engine.model.get_input_embeddings().num_embeddings, lp.TokenText(engine.tokenizer),
        max_len and max_len * longest * 4)
    app.on_event("shutdown")(scheduler.close)
    app.add_exception_handler(api.ApiError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _internal)
    app.add_middleware(KeyCheck, api_key=api_key)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    return app


def _deployment(request: Request) -> Deployment:
    return request.app.state.deployment


# -- errors and the API key ------------------------------------------------------------------
async def _api_error(request, e: api.ApiError):
    return JSONResponse(e.body(), status_code=e.status)


async def _http_error(request, e: HTTPException):
    return JSONResponse(api.ApiError(e.status_code, str(e.detail)).body(),
                        status_code=e.status_code)


async def _validation_error(request, e):
    return JSONResponse(api.ApiError(400, "invalid request").body(), status_code=400)


async def _internal(request, e):  # logged by uvicorn; the client gets no traceback
    return JSONResponse(api.ApiError(500, "internal server error").body(), status_code=500)


class KeyCheck:
    """/v1 routes need `Authorization: Bearer <key>` when the server has a key (an ASGI
    middleware: the request's messages, its disconnect included, reach the routes as sent)."""

    def __init__(self, app, api_key: str | None):
        self.app, self.key = app, api_key

    async def __call__(self, scope, receive, send):
        if self.key is not None and scope["type"] == "http" and \
                scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            token = given[7:] if given.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.key.encode()):
                response = JSONResponse(api.ApiError(
                    401, "invalid or missing API key (send Authorization: Bearer <key>)",
                    code="invalid_api_key").body(), status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# -- routes ----------------------------------------------------------------------------------
def health(request: Request):
    s = _deployment(request).scheduler
    return {"status": "ok", "running": s.busy, "waiting": s.waiting}


def models(request: Request):
    d = _deployment(request)
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": d.created, "owned_by": "swiftlite"}
        for name in d.served]}


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) past `limit` bytes before more of it is read."""
    too_big = api.ApiError(413, f"the request body is over {limit} bytes, the most this server "
                           "takes (start swiftlite deploy with a larger --max_request_size to "
                           "allow more)", code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def body_of(request: Request) -> dict:
    d = _deployment(request)
    raw = await read_body(request, d.max_request_bytes)
    try:  # a few MB of JSON takes tens of ms: not on the event loop
        body = json.loads(raw) if len(raw) < 2 ** 16 else await asyncio.to_thread(json.loads, raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise api.ApiError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise api.ApiError(400, "the request body must be a JSON object")
    name, served = body.get("model"), d.served
    if name not in served:
        raise api.ApiError(404, f"model {name!r} is not served here; served: "
                           f"{', '.join(served)}", param="model", code="model_not_found")
    api.check_unicode(body)
    return body


def check_chars(d: Deployment, chars: int, param: str) -> None:
    """Refused without tokenising: more characters than the whole context could hold."""
    if d.max_chars is not None and chars > d.max_chars:
        raise api.ApiError(400, f"the prompt has {chars} characters, more than this model's "
                           f"{d.max_len} tokens can hold", param=param,
                           code="context_length_exceeded")


def make_jobs(d: Deployment, ids: list[int], params: dict, adapter, loop, param="messages",
              score_prompt: bool = False) -> list[tuple[Job, asyncio.Queue]]:
    """A prompt's n jobs (not queued yet). score_prompt: the first job also returns the
    prompt's log-probs (the other choices share them)."""
    max_len = d.max_len
    if max_len is not None and len(ids) + (params["max_tokens"] > 0) > max_len:
        raise api.ApiError(400, f"the prompt has {len(ids)} tokens; this model takes at "
                           f"most {max_len}", param=param, code="context_length_exceeded")
    limit = params["max_tokens"] if max_len is None else min(params["max_tokens"],
                                                             max_len - len(ids))
    out = []
    for k in range(params["n"]):
        q: asyncio.Queue = asyncio.Queue()
        seed = None if params["seed"] is None else (params["seed"] + k) % 2 ** 63
        job = Job(ids=ids, max_tokens=limit, temperature=params["temperature"],
                  top_p=params["top_p"], seed=seed, stop=params["stop"], adapter=adapter,
                  logprobs=params["logprobs"], prompt_logprobs=score_prompt and k == 0,
                  emit=lambda kind, payload, q=q: loop.call_soon_threadsafe(
                      q.put_nowait, (kind, payload)))
        out.append((job, q))
    return out


def submit(d: Deployment, pairs) -> None:
    try:
        d.scheduler.submit([j for j, _ in pairs])
    except QueueFull:
        raise api.ApiError(429, f"the server is busy ({d.max_queue_size} requests waiting); "
                           "retry later", code="queue_full") from None


def encode(engine, messages, tools) -> list[int]:
    try:
        return engine.encode(messages, tools)
    except UsageError as e:
        raise api.ApiError(400, str(e), param="messages") from None


async def chat(request: Request):
    d, body = _deployment(request), await body_of(request)
    engine = d.engine
    params = api.sampling(body, 512)
    messages, tools = api.chat_inputs(body)
    check_chars(d, sum(len(m["content"]) for m in messages
                       if isinstance(m.get("content"), str)), "messages")
    ids = await asyncio.to_thread(encode, engine, messages, tools)
    pairs = make_jobs(d, ids, params, d.served[body["model"]], asyncio.get_running_loop())
    submit(d, pairs)
    rid, name = api.new_id("chatcmpl"), body["model"]
    parse = bool(tools) and d.tool_syntax
    want_lp = params["logprobs"] is not None
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(replies.chat_stream(
            d, rid, name, pairs, len(ids), parse, include_usage, want_lp),
            media_type="text/event-stream")
    results = await replies.finish_all(request, pairs)
    choices = []
    for k, o in enumerate(results):
        message, finish = {"role": "assistant", "content": o.text}, o.done["finish_reason"]
        if parse:
            reply = engine.parse(o.text)
            if reply["tool_calls"]:
                message = {"role": "assistant", "content": reply["content"] or None,
                           "tool_calls": reply["tool_calls"]}
                finish = "tool_calls"
        choices.append({"index": k, "message": message, "finish_reason": finish,
                        "logprobs": lp.chat(o.tokens, d.tokens) if want_lp else None})
    return api.chat_response(rid, name, choices, api.usage(
        len(ids), sum(o.done["completion_tokens"] for o in results)))


def tokenize(tokenizer, items: list, many: bool) -> list[list[int]]:
    """The ids of each prompt (a worker thread's job: megabytes of text take seconds)."""
    out = []
    for i, item in enumerate(items):
        ids = tokenizer(item, add_special_tokens=False)["input_ids"] if isinstance(item, str) \
            else item
        if not ids:
            param = f"prompt[{i}]" if many else "prompt"
            raise api.ApiError(400, f"{param}: has no tokens", param=param)
        out.append(ids)
    return out


async def completions(request: Request):
    d, body = _deployment(request), await body_of(request)
    params = api.sampling(body, 16, chat=False)
    items, many = api.prompts(body)
    if len(items) * params["n"] > d.max_queue_size:
        raise api.ApiError(400, f"prompt: {len(items)} prompts x n={params['n']} choices is "
                           f"more than this server queues ({d.max_queue_size})", param="prompt")
    echo, want_lp = params["echo"], params["logprobs"] is not None
    for i, item in enumerate(items):
        param = f"prompt[{i}]" if many else "prompt"
        if isinstance(item, str):
            check_chars(d, len(item), param)
        else:
            api.check_ids(item, d.vocab, param)
    all_ids = await asyncio.to_thread(tokenize, d.engine.tokenizer, items, many)
    loop, pairs = asyncio.get_running_loop(), []  # pairs: n per prompt, in order
    for i, ids in enumerate(all_ids):
        pairs += make_jobs(d, ids, params, d.served[body["model"]], loop,
                           f"prompt[{i}]" if many else "prompt", score_prompt=echo and want_lp)
    submit(d, pairs)  # all of them or none: every prompt was checked first
    n, rid, name = params["n"], api.new_id("cmpl"), body["model"]
    echoed = [(item if isinstance(item, str) else d.engine.tokenizer.decode(ids)) if echo
              else "" for item, ids in zip(items, all_ids)]
    if body.get("stream"):
        return StreamingResponse(replies.completion_stream(d, rid, name, pairs, echoed, n, echo,
                                                           want_lp),
                                 media_type="text/event-stream")
    results = await replies.finish_all(request, pairs)
    choices = []
    for c, o in enumerate(results):
        i, logprobs = c // n, None
        if want_lp:
            scored = (results[i * n].prompt or []) if echo else []
            logprobs = lp.legacy(scored + o.tokens, d.tokens)[0]
        choices.append({"index": c, "text": echoed[i] + o.text,
                        "finish_reason": o.done["finish_reason"], "logprobs": logprobs})
    return replies.completion_object(rid, name, choices, api.usage(
        sum(map(len, all_ids)), sum(o.done["completion_tokens"] for o in results)))
