"""Serving benchmark: OpenAI-compatible servers side by side, N concurrent streaming clients.

For each server (one at a time: it is started, measured at every concurrency, then stopped)
and each concurrency C, C clients each send R chat requests one after another (fixed prompts,
max_tokens, temperature 0, streamed) and the script prints one JSON line:
  out_tok_per_s   completion tokens of all requests / wall time of the level
  req_per_s       requests / wall time
  ttft_p50/p95_s  time to the first content token
  lat_p50/p95_s   time to the end of the answer
  tokens_src      "usage" (the server's own count, stream_options.include_usage) or "deltas"
                  (content chunks counted, for servers that do not send usage)

  python benchmarks/bench_deploy.py --servers swiftlite-pt,swiftlite-vllm,vllm,msswift,llamafactory \
      --concurrency 1,4,16,64 --requests_per_client 2 --max_tokens 64

Servers and where they come from (stdlib only here; each server runs in its own venv):
  swiftlite-pt     this checkout's .venv: swiftlite deploy (defaults) --torch_dtype float32
  swiftlite-vllm   swiftlite deploy --infer_backend vllm --vllm_python $VLLM_PYTHON (bf16)
  vllm             vLLM's own server from $VLLM_PYTHON, same model, dtype and max length
  msswift          $VENVS/msswift: swift deploy --infer_backend transformers (fp32)
  llamafactory     $VENVS/llamafactory: llamafactory-cli api, huggingface backend (fp32)
(VENVS defaults to /tmp/bench_venvs, made by benchmarks/peers/install_peers.sh.) Run nothing
else meanwhile: on 2 cores any other work skews every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["Write a short story about a lighthouse keeper.",
           "Explain how a bicycle works, step by step.",
           "Describe a walk through a forest in autumn.",
           "List ten facts about the ocean and explain each."]


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(name: str, model: str, port: int, a) -> tuple[list[str], dict]:
    sl = [os.path.join(REPO, ".venv", "bin", "python"), "-m", "swiftlite.cli", "deploy",
          "--model", model, "--port", str(port)]
    vllm_common = ["--dtype", "bfloat16", "--max-model-len", str(a.max_model_len)]
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    if name == "swiftlite-pt":
        return sl + ["--torch_dtype", "float32", *a.swiftlite_args.split()], env
    if name == "swiftlite-vllm":
        return sl + ["--infer_backend", "vllm", "--vllm_python", a.vllm_python,
                     "--torch_dtype", "bfloat16", "--max_model_len", str(a.max_model_len)], env
    if name == "vllm":
        return [a.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--port", str(port), *vllm_common], env
    if name == "msswift":
        return [os.path.join(a.venvs, "msswift", "bin", "swift"), "deploy", "--model", model,
                "--model_type", "llama", "--template", "chatml", "--infer_backend",
                "transformers", "--torch_dtype", "float32", "--port", str(port)], env
    if name == "llamafactory":
        return [os.path.join(a.venvs, "llamafactory", "bin", "llamafactory-cli"), "api",
                "--model_name_or_path", model, "--template", "chatml", "--infer_backend",
                "huggingface", "--infer_dtype", "float32"], {**env, "API_PORT": str(port)}
    raise SystemExit(f"unknown server {name}")


def wait_ready(port: int, proc, timeout: float) -> str:
    """The first served model's id, once /v1/models answers."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                return json.load(r)["data"][0]["id"]
        except (OSError, ValueError, KeyError, IndexError):
            time.sleep(1)
    raise RuntimeError(f"the server did not answer within {timeout:.0f} s")


def one_request(port: int, model: str, prompt: str, max_tokens: int) -> dict:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, deltas, usage = None, 0, None
    with urllib.request.urlopen(req, timeout=1800) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                usage = chunk["usage"].get("completion_tokens")
            for c in chunk.get("choices") or []:
                if (c.get("delta") or {}).get("content"):
                    deltas += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0,
            "latency": time.perf_counter() - t0, "tokens": usage if usage else deltas,
            "src": "usage" if usage else "deltas"}


def level(port: int, model: str, clients: int, per_client: int, max_tokens: int) -> dict:
    results, errors = [], []
    lock = threading.Lock()

    def client(k):
        for j in range(per_client):
            try:
                r = one_request(port, model, PROMPTS[(k + j) % len(PROMPTS)], max_tokens)
                with lock:
                    results.append(r)
            except Exception as e:  # counted and reported, never silently dropped
                with lock:
                    errors.append(repr(e)[:200])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)

    def pct(key, q):
        xs = sorted(r[key] for r in results)
        return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None
    return {"concurrency": clients, "requests": len(results), "errors": len(errors),
            "error_sample": errors[:2], "wall_s": round(wall, 2),
            "out_tokens": tokens, "out_tok_per_s": round(tokens / wall, 2),
            "req_per_s": round(len(results) / wall, 3),
            "mean_out_tokens": round(statistics.mean(r["tokens"] for r in results), 1)
            if results else None,
            "ttft_p50_s": pct("ttft", 0.5), "ttft_p95_s": pct("ttft", 0.95),
            "lat_p50_s": pct("latency", 0.5), "lat_p95_s": pct("latency", 0.95),
            "tokens_src": sorted({r["src"] for r in results})}


def run_server(name: str, a) -> None:
    port = free_port()
    cmd, env = server_command(name, a.model, port, a)
    log_path = os.path.join(a.log_dir, f"{name}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **env}, start_new_session=True)
        try:
            t0 = time.time()
            served = wait_ready(port, proc, a.start_timeout)
            start_s = round(time.time() - t0, 1)
            one_request(port, served, PROMPTS[0], 8)  # warm-up, not measured
            for c in a.concurrency:
                row = {"server": name, "start_s": start_s, **level(
                    port, served, c, a.requests_per_client, a.max_tokens),
                       "max_tokens": a.max_tokens, "model": os.path.basename(a.model),
                       "cpu": cpu_model(), "cores": os.cpu_count(),
                       "date": time.strftime("%Y-%m-%d"), "cmd": " ".join(cmd[1:])}
                print(json.dumps(row), flush=True)
                if a.results:
                    with open(a.results, "a") as f:
                        f.write(json.dumps(row) + "\n")
        except RuntimeError as e:
            print(json.dumps({"server": name, "error": str(e), "log": log_path}), flush=True)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(60)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--servers", default="swiftlite-pt,swiftlite-vllm,vllm,msswift,llamafactory")
    p.add_argument("--model", default=None, help="model folder (default: swiftlite's SmolLM2)")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--requests_per_client", type=int, default=2)
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--max_model_len", type=int, default=1024)
    p.add_argument("--vllm_python", default=os.environ.get("SWIFTLITE_VLLM_PYTHON") or
                   os.path.join(REPO, ".venv-vllm", "bin", "python"))
    p.add_argument("--venvs", default=os.environ.get("VENVS", "/tmp/bench_venvs"))
    p.add_argument("--start_timeout", type=float, default=600)
    p.add_argument("--log_dir", default="/tmp/bench_deploy")
    p.add_argument("--swiftlite_args", default="", help="more flags for swiftlite-pt, e.g. "
                   "'--max_batch_size 32'")
    p.add_argument("--results", default=None, help="also append the JSON lines to this file")
    a = p.parse_args()
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    os.makedirs(a.log_dir, exist_ok=True)
    if a.model is None:
        sys.path.insert(0, REPO)
        from swiftlite.models.builtin import build
        a.model = build("SmolLM2-135M-Instruct")
    for name in a.servers.split(","):
        run_server(name, a)


if __name__ == "__main__":
    main()
