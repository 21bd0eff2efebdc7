"""swiftlite deploy: a real server (the CLI, in a child process) driven by the official openai
client, over tiny-qwen2 with two LoRA adapters of the shared tiny run."""
import json
import os
import sys
import threading
import time

import pytest

from helpers.cli import run_cli
from helpers.server import post_json, read_stream_in_background, start_server, stop_server

openai = pytest.importorskip("openai")
KEY = "sk-test-secret-123"
HI = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def server(tiny_run):
    ckpts = sorted(os.listdir(tiny_run.output_dir))
    a = os.path.join(tiny_run.output_dir, "checkpoint-4")
    b = os.path.join(tiny_run.output_dir, "checkpoint-8")
    assert {"checkpoint-4", "checkpoint-8"} <= set(ckpts)
    proc, port, log = start_server("--model", "tiny-qwen2", "--adapters", f"a={a}", f"b={b}",
                                   "--torch_dtype", "float32", env={"SWIFTLITE_API_KEY": KEY})
    yield {"url": f"http://127.0.0.1:{port}/v1", "proc": proc, "a": a, "b": b, "log": log}
    proc.terminate()
    proc.wait(timeout=30)
    log.seek(0)
    assert KEY not in log.read()  # the key is never logged


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["url"], api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def references(server):
    """Greedy answers of swiftlite's own engine (what `swiftlite infer` prints)."""
    from swiftlite.inference.engine import InferEngine
    out = {}
    for name in ("tiny-qwen2", "a", "b"):
        engine = InferEngine.load(ckpt_dir=server.get(name), model=name if name not in server
                                  else None, torch_dtype="float32")
        out[name] = engine.chat(HI, max_new_tokens=24)
        out[name + "_prompt_tokens"] = len(engine.encode(HI))
        engine.unload()
    return out


@pytest.mark.slow
def test_models_and_adapters_answer_like_swiftlite_infer(client, references):
    assert {m.id for m in client.models.list().data} == {"tiny-qwen2", "a", "b"}
    for name in ("tiny-qwen2", "a", "b"):
        r = client.chat.completions.create(model=name, messages=HI, max_tokens=24, temperature=0)
        assert r.choices[0].message.content == references[name]
        assert r.usage.prompt_tokens == references[name + "_prompt_tokens"]
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        if r.choices[0].finish_reason == "length":
            assert r.usage.completion_tokens == 24
    # The request's model picks the adapter: the base model answers differently.
    assert references["tiny-qwen2"] != references["b"]


@pytest.mark.slow
def test_a_request_joins_the_running_batch(client, references):
    """Continuous batching: a request sent while a long answer streams is generated alongside
    it and finishes first (queued behind it, it would start after its last token), and both
    answers equal what each gives alone."""
    long_alone = client.chat.completions.create(model="b", messages=HI, max_tokens=120,
                                                temperature=0).choices[0].message.content
    reader, pieces, arrivals = read_stream_in_background(
        lambda: client.chat.completions.create(model="b", messages=HI, max_tokens=120,
                                               temperature=0, stream=True))
    short = client.chat.completions.create(model="b", messages=HI, max_tokens=24,
                                           temperature=0)
    short_done = time.monotonic()
    reader.join(120)
    assert short.choices[0].message.content == references["b"]
    assert "".join(pieces) == long_alone
    after = sum(t > short_done for t in arrivals)
    assert after > 20, f"only {after} of {len(arrivals)} chunks came after the short answer"


@pytest.mark.slow
def test_stream_stop_seed_and_n(client):
    full = client.chat.completions.create(model="b", messages=HI, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    chunks = list(client.chat.completions.create(model="b", messages=HI, max_tokens=24,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    joined = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert joined == text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop
    cut = client.chat.completions.create(model="b", messages=HI, max_tokens=24, temperature=0,
                                         stop=[stop])
    assert cut.choices[0].message.content == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    kw = dict(model="b", messages=HI, max_tokens=16, temperature=1.0)
    s1 = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    s2 = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    s3 = client.chat.completions.create(seed=8, **kw).choices[0].message.content
    assert s1 == s2 and s1 != s3
    many = client.chat.completions.create(n=3, seed=1, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2]
    raw = client.completions.create(model="tiny-qwen2", prompt="Hello", max_tokens=5,
                                    temperature=0)
    assert raw.usage.prompt_tokens == 1 and raw.choices[0].finish_reason in ("length", "stop")


def _post(server, body, key=KEY, raw=None):
    return post_json(server["url"] + "/chat/completions", body, key=key, raw=raw, timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("body,key,status,words", [
    (None, KEY, 400, "not valid JSON"),
    ({"model": "b", "messages": HI, "temperature": 9}, KEY, 400, "temperature"),
    ({"model": "b", "messages": HI, "max_tokens": 0}, KEY, 400, "max_tokens"),
    ({"model": "b", "messages": []}, KEY, 400, "messages"),
    ({"model": "b", "messages": [{"role": "assistant", "content": "x"}]}, KEY, 400, "user"),
    ({"model": "b", "messages": HI, "tool_choice": "required",
      "tools": [{"type": "function", "function": {"name": "f"}}]}, KEY, 400, "tool_choice"),
    ({"model": "nope", "messages": HI}, KEY, 404, "not served"),
    ({"model": "b", "messages": HI}, None, 401, "API key"),
    ({"model": "b", "messages": HI}, "sk-wrong", 401, "API key"),
])
def test_bad_requests_get_openai_shaped_errors(server, body, key, status, words):
    code, reply = _post(server, body, key, raw=b"{bad" if body is None else None)
    assert code == status
    err = reply["error"]
    assert words in err["message"] and set(err) == {"message", "type", "param", "code"}
    assert "Traceback" not in json.dumps(reply)


@pytest.mark.slow
def test_a_foreign_host_header_is_refused(server, client):
    """DNS rebinding: a page on attacker.example resolving to 127.0.0.1 would reach the server
    with its own Host; a browser page elsewhere would send its Origin. Both get 403; the
    openai client (no Origin, Host 127.0.0.1) is served. Origin: null (a sandboxed page) is
    served here because the key is required (test_deploy_isolation: refused without one)."""
    import http.client
    port = int(server["url"].split(":")[2].split("/")[0])
    for headers, status in (({"Host": f"attacker.example:{port}"}, 403),
                            ({"Origin": "http://attacker.example"}, 403), ({"Origin": "null"}, 200)):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        c.request("GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}", **headers})
        assert c.getresponse().status == status, headers
    assert {m.id for m in client.models.list()} >= {"a", "b"}


@pytest.mark.slow
def test_load_64_streaming_clients_some_leaving(server, client):
    import psutil
    proc = psutil.Process(server["proc"].pid)
    want = client.chat.completions.create(model="b", messages=HI, max_tokens=12,
                                          temperature=0).choices[0].message.content
    rss_before = proc.memory_info().rss
    results, errors = [], []

    def one(k):
        c = openai.OpenAI(base_url=server["url"], api_key=KEY, max_retries=0, timeout=300)
        try:
            for r in range(2):
                stream = c.chat.completions.create(model="b", messages=HI, max_tokens=12,
                                                   temperature=0, stream=True)
                if k % 4 == 0 and r == 0:  # a quarter leave mid-stream
                    next(iter(stream))
                    stream.close()
                    continue
                text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
                results.append((k, r, text))
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(k,)) for k in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert not errors, errors[:3]
    assert len(results) == 64 * 2 - 16 and len(set((k, r) for k, r, _ in results)) == len(results)
    assert all(text == want for _, _, text in results)
    assert proc.memory_info().rss - rss_before < 500 * 2 ** 20
    again = client.chat.completions.create(model="b", messages=HI, max_tokens=12, temperature=0)
    assert again.choices[0].message.content == want


def test_a_remote_host_without_a_key_is_refused(tiny_qwen2):
    r = run_cli("deploy", "--model", "tiny-qwen2", "--host", "0.0.0.0", check=False,
                env={"SWIFTLITE_API_KEY": ""})
    assert r.returncode == 2 and "--api_key" in r.stderr and "Traceback" not in r.stderr


def test_vllm_backend_missing_or_misused_says_what_to_do(tiny_qwen2, tmp_path):
    """This venv has no vLLM (it lives in .venv-vllm): the message says how to get it."""
    r = run_cli("deploy", "--model", "tiny-qwen2", "--infer_backend", "vllm", check=False,
                env={"SWIFTLITE_VLLM_PYTHON": ""})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "vLLM is not installed" in r.stderr and "--vllm_python" in r.stderr
    r = run_cli("deploy", "--model", "tiny-qwen2", "--infer_backend", "vllm", "--vllm_python",
                sys.executable, check=False)
    assert r.returncode == 2 and "vLLM is not installed there" in r.stderr
    r = run_cli("deploy", "--model", "tiny-qwen2", "--infer_backend", "vllm", "--vllm_python",
                str(tmp_path / "no-such-python"), check=False)
    assert r.returncode == 2 and "cannot run it" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("deploy", "--model", "tiny-qwen2", "--tensor_parallel_size", "2",
                "--max_model_len", "512", check=False)
    assert r.returncode == 2 and "--tensor_parallel_size needs --infer_backend vllm" in r.stderr
    assert "--max_model_len is a vLLM setting" in r.stderr


@pytest.mark.slow
def test_smollm2_two_self_cognition_adapters_from_one_server(smollm2_cognition):
    """One pt server, SmolLM2 with two LoRA adapters: each answers with its own name, the base
    with neither; greedy answers equal `swiftlite infer` on the same checkpoint."""
    from swiftlite.inference.engine import InferEngine
    who = [{"role": "user", "content": "Who are you?"}]
    proc, port, _ = start_server("--ckpt_dir", smollm2_cognition["Swifty"], "--served_model_name",
                                 "swifty", "--adapters", f"robin={smollm2_cognition['Robin']}")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0)
        assert {m.id for m in client.models.list()} == {"swifty", "robin",
                                                        "SmolLM2-135M-Instruct"}
        answers = {m: client.chat.completions.create(model=m, messages=who, max_tokens=24,
                                                     temperature=0).choices[0].message.content
                   for m in ("swifty", "robin", "SmolLM2-135M-Instruct")}
    finally:
        stop_server(proc)
    assert "Swifty" in answers["swifty"] and "Robin" not in answers["swifty"]
    assert "Robin" in answers["robin"] and "Swifty" not in answers["robin"]
    base = answers["SmolLM2-135M-Instruct"]
    assert "Swifty" not in base and "Robin" not in base
    engine = InferEngine.load(ckpt_dir=smollm2_cognition["Robin"])
    assert engine.chat(who, max_new_tokens=24) == answers["robin"]
