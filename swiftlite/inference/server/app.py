"""The FastAPI application of `swiftlite deploy`: OpenAI's /v1/models, /v1/chat/completions
and /v1/completions over one loaded engine (a base model and its named LoRA adapters).

Every error is answered in OpenAI's shape with its status (400 bad request, 401 key, 404
model or route, 429 queue full, 500 with no traceback); the API key is compared in constant
time and never logged. Log-probabilities (chat's logprobs/top_logprobs, completions'
logprobs/echo) are shaped by `logprobs` from what the scheduler computes.
"""
import asyncio
import hmac
import json
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from swiftlite.data.tools import TOOL_CALL_OPEN, writes_tool_calls
from swiftlite.errors import UsageError
from swiftlite.inference.server import logprobs as lp
from swiftlite.inference.server import openai_api as api
from swiftlite.inference.server.scheduler import Job, QueueFull, Scheduler

_TOOL_OPEN = TOOL_CALL_OPEN


@dataclass
class Deployment:
    """What the handlers share, kept on app.state.deployment."""
    engine: object
    served: dict  # model name -> adapter name (None: the base model)
    scheduler: Scheduler
    api_key: str | None
    max_queue_size: int
    created: int
    max_len: int | None  # the model's context, when its config says
    tool_syntax: bool  # the template writes tool calls the engine can parse
    vocab: int  # the model's embedding rows: prompt token ids must be below
    tokens: lp.TokenText  # token ids -> their text and bytes, for log-probs


@dataclass
class Outcome:
    """What one job said: its text, its "done" payload, and its log-probs when asked."""
    text: str = ""
    done: dict = field(default_factory=dict)
    tokens: list = field(default_factory=list)  # scheduler.TokenLogprob per generated token
    prompt: list | None = None  # per prompt token, when the job scored its prompt


def create_app(engine, served: dict[str, str | None], *, api_key: str | None = None,
               max_batch_size: int = 8, max_queue_size: int = 64):
    """served: model name -> adapter name (None: the base model)."""
    app = FastAPI(title="swiftlite deploy", docs_url=None, redoc_url=None, openapi_url=None)
    scheduler = Scheduler(engine, max_batch_size=max_batch_size, max_queue_size=max_queue_size)
    app.state.scheduler = scheduler
    app.state.deployment = Deployment(
        engine, served, scheduler, api_key, max_queue_size, int(time.time()),
        int(getattr(engine.model.config, "max_position_embeddings", 0) or 0) or None,
        writes_tool_calls(getattr(engine.template, "source", None)),
        engine.model.get_input_embeddings().num_embeddings, lp.TokenText(engine.tokenizer))
    app.on_event("shutdown")(scheduler.close)
    app.add_exception_handler(api.ApiError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _internal)
    app.middleware("http")(_auth)
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


async def _auth(request: Request, call_next):
    api_key = _deployment(request).api_key
    if api_key is not None and request.url.path.startswith("/v1"):
        given = request.headers.get("authorization", "")
        token = given[7:] if given.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), api_key.encode()):
            return JSONResponse(api.ApiError(
                401, "invalid or missing API key (send Authorization: Bearer <key>)",
                code="invalid_api_key").body(), status_code=401)
    return await call_next(request)


# -- routes ----------------------------------------------------------------------------------
def health():
    return {"status": "ok"}


def models(request: Request):
    d = _deployment(request)
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": d.created, "owned_by": "swiftlite"}
        for name in d.served]}


async def body_of(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError):
        raise api.ApiError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise api.ApiError(400, "the request body must be a JSON object")
    name, served = body.get("model"), _deployment(request).served
    if name not in served:
        raise api.ApiError(404, f"model {name!r} is not served here; served: "
                           f"{', '.join(served)}", param="model", code="model_not_found")
    return body

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
        seed = None if params["seed"] is None else params["seed"] + k
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


async def finish_all(request: Request, pairs) -> list[Outcome]:
    """Wait for every job's outcome; a client that leaves cancels its jobs."""
    results = []
    try:
        for job, q in pairs:
            o = Outcome()
            while True:
                try:
                    kind, payload = await asyncio.wait_for(q.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        raise asyncio.CancelledError() from None
                    continue
                if kind == "delta":
                    o.text += payload
                elif kind == "token":
                    o.tokens.append(payload)
                elif kind == "prompt":
                    o.prompt = payload
                elif kind == "error":
                    raise api.ApiError(500, payload)
                else:
                    o.done = payload
                    results.append(o)
                    break
    finally:
        for job, _ in pairs:
            job.cancelled.set()
    return results

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
    loop = asyncio.get_running_loop()
    ids = await loop.run_in_executor(None, encode, engine, messages, tools)
    pairs = make_jobs(d, ids, params, d.served[body["model"]], loop)
    submit(d, pairs)
    rid, name = api.new_id("chatcmpl"), body["model"]
    parse = bool(tools) and d.tool_syntax
    want_lp = params["logprobs"] is not None
    if not body.get("stream"):
        results = await finish_all(request, pairs)
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
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    return StreamingResponse(_chat_stream(d, rid, name, pairs, ids, parse, include_usage,
                                          want_lp), media_type="text/event-stream")


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _chat_stream(d, rid, name, pairs, ids, parse, include_usage, want_lp):
    engine = d.engine
    completion = 0
    try:
        for k, (job, q) in enumerate(pairs):
            yield sse(api.chat_chunk(rid, name, k, {"role": "assistant", "content": ""}))
        # Choices stream one after the other (n > 1 is rare; each is generated in parallel).
        for k, (job, q) in enumerate(pairs):
            text, held, pending = "", "", []

            def chunk(delta, finish=None):
                # A chunk carries the log-probs of the tokens that arrived since the last one.
                nonlocal pending
                out = api.chat_chunk(rid, name, k, delta, finish,
                                     lp.chat(pending, d.tokens) if want_lp and pending else None)
                pending = []
                return sse(out)
            while True:
                kind, payload = await q.get()
                if kind == "error":
                    yield sse(api.ApiError(500, payload).body())
                    return
                if kind == "token":
                    pending.append(payload)
                    continue
                if kind == "delta":
                    text += payload
                    if parse and (_TOOL_OPEN in text or _partial_open(text)):
                        held += payload  # maybe a tool call: decided at the end
                        continue
                    piece, held = held + payload, ""
                    yield chunk({"content": piece})
                    continue
                completion += payload["completion_tokens"]
                finish = payload["finish_reason"]
                reply = engine.parse(text) if parse else {"tool_calls": []}
                if reply["tool_calls"]:
                    before = text[:len(text) - len(held)]
                    rest = reply["content"][len(before.strip()):] if reply["content"] else ""
                    if rest.strip():
                        yield chunk({"content": rest})
                    yield chunk({"tool_calls": [
                        {"index": i, **c} for i, c in enumerate(reply["tool_calls"])]})
                    finish = "tool_calls"
                elif held:
                    yield chunk({"content": held})
                yield chunk({}, finish)
                break
        if include_usage:
            yield sse({"id": rid, "object": "chat.completion.chunk",
                       "created": int(time.time()), "model": name, "choices": [],
                       "usage": api.usage(len(ids), completion)})
        yield "data: [DONE]\n\n"
    finally:  # also when the client disconnects mid-stream
        for job, _ in pairs:
            job.cancelled.set()


async def completions(request: Request):
    d, body = _deployment(request), await body_of(request)
    params = api.sampling(body, 16, chat=False)
    items, many = api.prompts(body)
    if len(items) * params["n"] > d.max_queue_size:
        raise api.ApiError(400, f"prompt: {len(items)} prompts x n={params['n']} choices is "
                           f"more than this server queues ({d.max_queue_size})", param="prompt")
    echo, want_lp = params["echo"], params["logprobs"] is not None
    loop = asyncio.get_running_loop()
    prompts, pairs = [], []  # prompts: (ids, text) per prompt; pairs: n per prompt, in order
    for i, item in enumerate(items):
        param = f"prompt[{i}]" if many else "prompt"
        if isinstance(item, str):
            ids = d.engine.tokenizer(item, add_special_tokens=False)["input_ids"]
            if not ids:
                raise api.ApiError(400, f"{param}: has no tokens", param=param)
        else:
            api.check_ids(item, d.vocab, param)
            ids = item
        prompts.append((ids, item))
        pairs += make_jobs(d, ids, params, d.served[body["model"]], loop, param,
                           score_prompt=echo and want_lp)
    submit(d, pairs)  # all of them or none: every prompt was checked first
    n, rid, name = params["n"], api.new_id("cmpl"), body["model"]

    def echoed(i) -> str:
        ids, item = prompts[i]
        return item if isinstance(item, str) else d.engine.tokenizer.decode(ids)

    def obj(choices, usage=None):
        out = {"id": rid, "object": "text_completion", "created": int(time.time()),
               "model": name, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out
    if not body.get("stream"):
        results = await finish_all(request, pairs)
        choices = []
        for c, o in enumerate(results):
            i = c // n
            logprobs = None
            if want_lp:
                scored = (results[i * n].prompt or []) if echo else []
                logprobs = lp.legacy(scored + o.tokens, d.tokens)[0]
            choices.append({"index": c, "text": (echoed(i) if echo else "") + o.text,
                            "finish_reason": o.done["finish_reason"], "logprobs": logprobs})
        return obj(choices, api.usage(sum(len(ids) for ids, _ in prompts),
                                      sum(o.done["completion_tokens"] for o in results)))

    async def stream():
        def chunk(c, text, entries=None, finish=None):
            nonlocal offset
            logprobs = None
            if want_lp and entries:
                logprobs, offset = lp.legacy(entries, d.tokens, offset)
            return sse(obj([{"index": c, "text": text, "logprobs": logprobs,
                             "finish_reason": finish}]))
        scored = {}  # prompt -> its log-probs, from its first choice's job
        try:
            for c, (job, q) in enumerate(pairs):
                i, offset, pending = c // n, 0, []
                if echo and not job.prompt_logprobs:
                    yield chunk(c, echoed(i), scored.get(i))
                while True:
                    kind, payload = await q.get()
                    if kind == "error":
                        yield sse(api.ApiError(500, payload).body())
                        return
                    if kind == "prompt":
                        scored[i] = payload
                        yield chunk(c, echoed(i), payload)
                    elif kind == "token":
                        pending.append(payload)
                    elif kind == "delta":
                        yield chunk(c, payload, pending)
                        pending = []
                    else:
                        yield chunk(c, "", pending, payload["finish_reason"])
                        break
            yield "data: [DONE]\n\n"
        finally:
            for job, _ in pairs:
                job.cancelled.set()
    return StreamingResponse(stream(), media_type="text/event-stream")


def _partial_open(text: str) -> bool:
    """The text ends with the start of "<tool_call>" (hold it back until we know)."""
    return any(text.endswith(_TOOL_OPEN[:n]) for n in range(1, len(_TOOL_OPEN)))
