"""Shared fixtures: the real models (built once into the swiftlite cache) and a small
trained tiny-qwen2 checkpoint reused by the merge/infer/web-ui tests."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from swiftlite.runtime.hardware import CPU_BF16_FLAGS, cpu_has_bf16

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("WANDB_DISABLED", "true")
# The venv's tools first, as in an activated venv: DeepSpeed JIT-builds its CPU ops with the
# `ninja` it finds on PATH, and the venv's (1.13) and Debian's (1.11) log a command under
# different hashes, so tests alternating between them rebuilt CPU Adam (70-90 s) and the shm
# communication op (50 s) each time.
_BIN = os.path.dirname(sys.executable)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _BIN:
    os.environ["PATH"] = _BIN + os.pathsep + os.environ.get("PATH", "")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHAT_ROWS = [
    {"messages": [{"role": "user", "content": "What is 2+2?"},
                  {"role": "assistant", "content": "2+2 is 4."}]},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Capital of France?"},
                  {"role": "assistant", "content": "Paris."},
                  {"role": "user", "content": "And of Italy?"},
                  {"role": "assistant", "content": "Rome."}]},
    {"messages": [{"role": "user", "content": "Say hello in Chinese."},
                  {"role": "assistant", "content": "你好！😀"}]},
    {"messages": [{"role": "user", "content": "Name three colours."},
                  {"role": "assistant", "content": "Red, green and blue."}]},
]


def write_jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
    return str(path)


def run_cli(*args, env=None, cwd=None, timeout=900, check=True):
    """Run `swiftlite ...` as a user would (a child process); returns CompletedProcess."""
    full_env = {**os.environ, **(env or {})}
    r = subprocess.run([sys.executable, "-m", "swiftlite.cli", *map(str, args)],
                       capture_output=True, text=True, env=full_env, cwd=cwd, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"swiftlite {' '.join(map(str, args))} exited {r.returncode}\n"
                             f"--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-8000:]}")
    return r


@pytest.fixture(scope="session")
def tiny_qwen2() -> str:
    from swiftlite.models.builtin import build
    return build("tiny-qwen2")


@pytest.fixture(scope="session")
def smollm2() -> str:
    from swiftlite.models.builtin import build
    return build("SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def chat_jsonl(tmp_path_factory) -> str:
    return write_jsonl(tmp_path_factory.mktemp("data") / "chat.jsonl", CHAT_ROWS)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, tiny_qwen2, chat_jsonl):
    """A finished tiny-qwen2 LoRA run (8 steps, checkpoints at 4 and 8)."""
    import swiftlite
    out = tmp_path_factory.mktemp("tiny_run")
    return swiftlite.sft(model="tiny-qwen2", dataset=[chat_jsonl + "#32"], max_steps=8,
                         per_device_train_batch_size=4, gradient_accumulation_steps=1,
                         learning_rate=2e-2, save_steps=4, logging_steps=1,
                         # fp32 even on a bf16 CPU: the merge tests check logits to 1e-4
                         torch_dtype="float32", output_dir=str(out))  # default report_to: tensorboard (runs/)


# -- servers (swiftlite deploy in a child process) -----------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*flags, env=None, wait_s=120):
    """`swiftlite deploy ... --port P` in a child process, once /health answers:
    (process, port, log file)."""
    port = free_port()
    log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"deploy-{port}.log"), "w+")
    proc = subprocess.Popen([sys.executable, "-m", "swiftlite.cli", "deploy", "--port", str(port),
                             *map(str, flags)], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})
    deadline = time.time() + wait_s
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc, port, log
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.5)
    log.seek(0)
    proc.kill()
    raise AssertionError("the server did not start:\n" + log.read()[-4000:])


def post_json(url: str, body=None, *, key=None, raw: bytes | None = None, timeout=120):
    """POST a JSON body (or raw bytes) to a server route: (status, the parsed JSON answer),
    error answers included."""
    import urllib.error
    req = urllib.request.Request(url, data=raw if raw is not None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def read_stream_in_background(open_stream):
    """Reads the streamed chat completion open_stream() returns in a thread, noting when each
    chunk arrived: (thread, text pieces, arrival times); waits until 4 chunks have come."""
    import threading
    pieces, arrivals, started = [], [], threading.Event()

    def read():
        for chunk in open_stream():
            pieces.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
            arrivals.append(time.monotonic())
            if len(pieces) == 4:
                started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(60), "the stream never sent 4 chunks"
    return reader, pieces, arrivals


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


# A CPU without bf16 units (AVX2 only: none of runtime.hardware.CPU_BF16_FLAGS) emulates bf16
# matmuls at about a hundredth of its fp32 rate, and swiftlite trains in fp32 there. The long
# bf16 training tests run where swiftlite would train in bf16 (two of the three CPU kinds seen).
needs_bf16_units = pytest.mark.skipif(
    not cpu_has_bf16(), reason=f"this CPU emulates bf16 matmuls (none of "
                               f"{' '.join(CPU_BF16_FLAGS)}), at about 1/100 of its fp32 rate; "
                               "swiftlite trains in fp32 here")
BF16_CPU_TRAINING = pytest.param("bfloat16", marks=needs_bf16_units, id="bfloat16")


# vLLM lives in a venv of its own (scripts/setup_vllm.sh; CI makes it).
VLLM_PYTHON = os.environ.get("SWIFTLITE_VLLM_PYTHON") or os.path.join(REPO, ".venv-vllm", "bin",
                                                                       "python")
needs_vllm = pytest.mark.skipif(not os.path.exists(VLLM_PYTHON),
                                reason="no vLLM venv: run bash scripts/setup_vllm.sh")
# vLLM's CPU build reserves its KV cache up front (default 4 GiB); tiny models need little.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
# Eager: vLLM's torch.compile warm-up takes about 50 s per model on 2 cores.
VLLM_FLAGS = ("--vllm_args=--enforce-eager", "--max_model_len", "1024")
# vLLM's engine and worker in its API server's process instead of two more (each imports torch
# and vLLM again: 63-65 s to /health vs 48 s for tiny-qwen2 here). The tests of answers use it;
# the test of vLLM's process tree (test_deploy_vllm's SIGKILL) keeps vLLM's default layout.
VLLM_ONE_PROCESS_ENV = {**VLLM_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
VLLM_ONE_PROCESS_FLAGS = (VLLM_FLAGS[0] + " --distributed-executor-backend uni", *VLLM_FLAGS[1:])


# -- libraries kept in memory for the suite's child processes (see resident_libraries.py) ---------
RESIDENT = {
    sys.executable: ("torch", "transformers", "peft", "datasets", "accelerate", "deepspeed",
                     "transformers.trainer", "gradio", "swiftlite.cli"),
}


@pytest.fixture(scope="session", autouse=True)
def resident_libraries(tmp_path_factory):
    """One helper per venv holding the libraries that the suite's child processes import
    (vLLM's venv too, when there is one); they end with the session."""
    venvs = dict(RESIDENT)
    if os.path.exists(VLLM_PYTHON):
        venvs[VLLM_PYTHON] = ("vllm.entrypoints.openai.api_server", "vllm.v1.engine.core",
                              "vllm.v1.executor.multiproc_executor", "vllm.v1.worker.cpu_worker")
    log = open(tmp_path_factory.getbasetemp() / "resident_libraries.log", "w")
    helpers = [subprocess.Popen([python, os.path.join(REPO, "tests", "resident_libraries.py"),
                                 *modules], stdout=subprocess.PIPE, stderr=log, text=True)
               for python, modules in venvs.items()]
    # Wait until they hold their files (about 30 s): importing next to a test would take CPU
    # from its two OpenMP threads, which then wait for each other.
    for helper in helpers:
        for line in helper.stdout:  # libraries print to stdout too; the helper's line ends it
            log.write(line)
            if line.startswith("resident_libraries:"):
                break
    log.flush()
    yield
    for helper in helpers:
        helper.kill()
        helper.wait()
    log.close()


# -- SmolLM2 self-cognition adapters ---------------------------------------------------------------
# The README's self-cognition demo: the smallest run after which SmolLM2 answers with its new
# name. Keep in step with the README.
SELF_COGNITION_RECIPE = [
    "--model", "SmolLM2-135M-Instruct", "--dataset", "self-cognition#32",
    "--model_author", "Acme",
    "--max_steps", "4", "--per_device_train_batch_size", "8",
    "--gradient_accumulation_steps", "1", "--learning_rate", "2e-3", "--warmup_ratio", "0",
    "--lr_scheduler_type", "constant", "--report_to", "none"]


@pytest.fixture(scope="session")
def smollm2_cognition(tmp_path_factory, smollm2) -> dict:
    """Two SmolLM2 LoRA checkpoints that learned a name each: {"Swifty": dir, "Robin": dir}."""
    out = {}
    # Swifty is the README's recipe; "Robin" is not learned in 4 steps (SmolLM2 says "Alex").
    for name, steps in (("Swifty", "4"), ("Robin", "8")):
        run = tmp_path_factory.mktemp(f"cognition_{name}")
        recipe = list(SELF_COGNITION_RECIPE)
        recipe[recipe.index("--max_steps") + 1] = steps
        run_cli("sft", *recipe, "--model_name", name, "--output_dir", run, "--add_version",
                "false")
        out[name] = str(run / f"checkpoint-{steps}")
    return out


@pytest.fixture(scope="session")
def smollm2_merged(smollm2_cognition):
    """Swifty merged into SmolLM2: (folder, merge-lora's stdout)."""
    ckpt = smollm2_cognition["Swifty"]
    r = run_cli("merge-lora", "--ckpt_dir", ckpt)
    return ckpt + "-merged", r.stdout
