"""swiftlite deploy (pt) against requests meant to hurt it: one bad request never changes
another's answer, a client that leaves stops its work, a huge body is refused without
blocking anyone, a lone surrogate is the client's error, and a page of another site cannot
drive a server that has no key. One real server (the CLI, in a child process) over tiny-qwen2,
driven with the official openai client, httpx and raw sockets."""
import json
import socket
import threading
import time

import pytest

from helpers.server import read_stream_in_background, start_server, stop_server

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
HI = [{"role": "user", "content": "What is 2+2?"}]
# Sampled with a seed: a varied text (tiny-qwen2's greedy answer is a run of newlines) that is
# the same whenever it is asked, alone or beside others.
HEALTHY = dict(model="tiny-qwen2", messages=HI, max_tokens=40, temperature=1.0, seed=3)
pytestmark = pytest.mark.slow  # a server start


@pytest.fixture(scope="module")
def server(tiny_qwen2):
    proc, port, log = start_server("--model", "tiny-qwen2", "--torch_dtype", "float32")
    yield {"base": f"http://127.0.0.1:{port}", "port": port, "proc": proc, "log": log}
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key="none", max_retries=0,
                         timeout=60)


def _post(server, path, body=None, *, raw=None, timeout=30, **headers):
    headers = {"Content-Type": "application/json", **headers}
    r = httpx.post(server["base"] + path, content=raw if raw is not None else json.dumps(body),
                   headers=headers, timeout=timeout)
    return r.status_code, r.json()


BAD = [({"seed": 2 ** 64}, 400),  # seeding failed in the scheduler before the job was known
       ({"seed": -1}, 400),
       ({"temperature": 1e-300}, 200)]  # logits / 1e-300 = inf: NaN probabilities; now greedy


def test_a_bad_request_never_changes_another_requests_answer(server, client):
    """Bad requests sent while another generates: the healthy one's answer equals its answer
    alone, and each bad one is answered (with its status) instead of failing both or hanging.
    (tests/unit/test_deploy_scheduler.py fails jobs inside the scheduler itself.)"""
    alone = client.chat.completions.create(**HEALTHY).choices[0].message.content
    assert len(set(alone)) > 5  # a varied text, so a damaged answer would show
    reader, pieces, _ = read_stream_in_background(
        lambda: client.chat.completions.create(stream=True, **HEALTHY))
    answers = [None] * len(BAD)

    def send(i):
        try:
            answers[i] = _post(server, "/v1/chat/completions", {
                "model": "tiny-qwen2", "messages": HI, "max_tokens": 8, **BAD[i][0]},
                timeout=20)
        except httpx.HTTPError as e:  # never answered
            answers[i] = None, repr(e)
    senders = [threading.Thread(target=send, args=(i,)) for i in range(len(BAD))]
    for t in senders:
        t.start()
    for t in senders + [reader]:
        t.join(60)
    assert not reader.is_alive() and "".join(pieces) == alone
    greedy = client.chat.completions.create(model="tiny-qwen2", messages=HI, max_tokens=8,
                                            temperature=0).choices[0].message.content
    for (bad, status), (code, reply) in zip(BAD, answers):
        assert code == status, (bad, reply)
        if status == 400:
            assert "seed" in reply["error"]["message"] and reply["error"]["param"] == "seed"
        else:  # tiny temperatures are greedy
            assert reply["choices"][0]["message"]["content"] == greedy


def _cpu_seconds(proc) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def test_a_client_that_leaves_a_non_streaming_request_frees_the_cpu(server, client):
    """A non-streaming request for 4000 tokens, abandoned after 2 s: within a second or two
    the server stops generating (its CPU time stops growing), and it answers as before."""
    import psutil
    proc = psutil.Process(server["proc"].pid)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server["base"] + "/v1/chat/completions", timeout=2, json={
            "model": "tiny-qwen2", "messages": HI, "max_tokens": 4000, "temperature": 0})
    left = time.monotonic()  # httpx closed the connection
    idle = None
    while time.monotonic() - left < 5:
        before = _cpu_seconds(proc)
        time.sleep(0.5)
        if _cpu_seconds(proc) - before < 0.1:  # generating costs about 0.5 s of each 0.5 s
            idle = time.monotonic() - left
            break
    assert idle is not None and idle < 2.5, f"still generating {time.monotonic() - left:.1f}" \
                                            " s after the client left"
    health = httpx.get(server["base"] + "/health", timeout=10).json()
    assert health["running"] == 0 and health["waiting"] == 0, health
    r = client.chat.completions.create(model="tiny-qwen2", messages=HI, max_tokens=4)
    assert r.choices[0].finish_reason in ("length", "stop")


def _health_times(server, stop: threading.Event, out: list) -> None:
    while not stop.is_set():
        t = time.monotonic()
        assert httpx.get(server["base"] + "/health", timeout=30).status_code == 200
        out.append(time.monotonic() - t)
        time.sleep(0.05)


def test_a_huge_body_is_refused_while_health_answers(server):
    """A 30 MB body gets 413 naming --max_request_size, without being read (also sent chunked,
    with no Content-Length); a prompt under the cap but longer than any context gets 400 before
    it is tokenised, a shorter one is tokenised off the event loop: /health answers promptly
    all along."""
    stop, times = threading.Event(), []
    watcher = threading.Thread(target=_health_times, args=(server, stop, times))
    watcher.start()
    try:
        huge = json.dumps({"model": "tiny-qwen2", "prompt": "hello " * 5_000_000}).encode()
        t = time.monotonic()
        code, reply = _post(server, "/v1/completions", raw=huge, timeout=60)
        assert code == 413 and "--max_request_size" in reply["error"]["message"], reply
        assert time.monotonic() - t < 5

        def chunks():
            for _ in range(30):
                yield huge[:1_000_000]
        r = httpx.post(server["base"] + "/v1/completions", content=chunks(), timeout=60,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 413, r.text
        # Under the 4 MiB default, longer than any 4096 tokens can be: refused before tokenising.
        code, reply = _post(server, "/v1/completions", {
            "model": "tiny-qwen2", "prompt": "hello " * 600_000, "max_tokens": 1})
        assert code == 400 and reply["error"]["code"] == "context_length_exceeded", reply
        code, reply = _post(server, "/v1/chat/completions", {
            "model": "tiny-qwen2", "messages": [{"role": "user", "content": "hi " * 1_200_000}]})
        assert code == 400 and reply["error"]["code"] == "context_length_exceeded", reply
        # Short enough in characters to be tokenised (seconds of it), in a worker thread.
        code, reply = _post(server, "/v1/completions", {
            "model": "tiny-qwen2", "prompt": "hello " * 200_000, "max_tokens": 1}, timeout=60)
        assert code == 400 and "200001 tokens" in reply["error"]["message"], reply
    finally:
        stop.set()
        watcher.join(60)
    assert times and max(times) < 1.0, times


@pytest.mark.parametrize("path,body,field", [
    ("/v1/chat/completions", {"model": "tiny-qwen2", "messages": [
        {"role": "user", "content": "hi \ud800 there"}]}, "messages[0].content"),
    ("/v1/completions", {"model": "tiny-qwen2", "prompt": ["ok", "x\udfff"]}, "prompt[1]"),
])
def test_a_lone_surrogate_is_the_clients_error(server, path, body, field):
    code, reply = _post(server, path, raw=json.dumps(body))  # ensure_ascii: "\ud800" escapes
    assert code == 400, reply
    assert "surrogate" in reply["error"]["message"] and field in reply["error"]["message"]


def _raw_request(port: int, head: str, body: bytes = b"") -> tuple[int, str]:
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(head.encode() + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                  .encode() + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1].decode("utf-8", "replace")


def test_a_keyless_server_refuses_null_origins_and_non_json_bodies(server, client):
    """What a sandboxed iframe or a plain HTML form of another site can send: Origin null
    (403), a text/plain or type-less body (415). The openai client is served as before."""
    port, body = server["port"], json.dumps({"model": "tiny-qwen2", "prompt": "Hi",
                                             "max_tokens": 1}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
    status, text = _raw_request(port, head + "Origin: null\r\n"
                                "Content-Type: application/json\r\n", body)
    assert status == 403 and "Origin: null" in text, text
    status, _ = _raw_request(port, f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                             "Origin: null\r\n")
    assert status == 403
    for kind in ("text/plain", "application/x-www-form-urlencoded", None):
        status, text = _raw_request(port, head + (f"Content-Type: {kind}\r\n" if kind else ""),
                                    body)
        assert status == 415 and "application/json" in text, (kind, status, text)
    status, text = _raw_request(port, head + "Content-Type: application/json; charset=utf-8\r\n",
                                body)
    assert status == 200, text
    assert client.completions.create(model="tiny-qwen2", prompt="Hi", max_tokens=1).choices
