"""Batched answers from vLLM, for `swiftlite eval --infer_backend vllm`.

The same server `swiftlite deploy --infer_backend vllm` runs (vllm_backend: the checkpoint's
template, end-of-turn tokens and adapter), started on a free loopback port for the length of an
evaluation. Prompts are encoded here, by the template that encodes them for the pt engine, and
sent as token ids to /v1/completions: vLLM then answers exactly the prompt the pt engine would
see (no second rendering of the chat template), and the replies are read by the same parser.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import types
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from swiftlite.errors import UsageError
from swiftlite.inference.engine import Answer, InferEngine
from swiftlite.log import info

START_TIMEOUT_S = 900  # vLLM's CPU build loads and warms a model in 30-90 s on 2 cores


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmEngine(InferEngine):
    """InferEngine's prompts and parsing, with answer_batch served by a vLLM child process.
    Forward passes (loss, multiple choice) need the model in this process: there is none here."""

    def __init__(self, tokenizer, template, ckpt, proc, port: int, served: str, workdir):
        super().__init__(None, tokenizer, template, "cpu", ckpt, ckpt.torch_dtype or "auto")
        self._eos += [t for t in (tokenizer.eos_token_id,) if t is not None and t not in self._eos]
        self.proc, self.port, self.served, self._workdir = proc, port, served, workdir

    @classmethod
    def start(cls, ckpt_dir: str | None, model: str | None, args, log_path: str,
              **overrides) -> "VllmEngine":
        """vLLM's server for the checkpoint, once it answers /health. args: the backend group
        (infer_backend, vllm_python, tensor_parallel_size, max_model_len, vllm_args),
        max_batch_size and trust_remote_code; overrides: template, system, torch_dtype."""
        from swiftlite.inference.checkpoints import TEMPLATE_FIELDS, describe
        from swiftlite.inference.server import vllm_backend
        from swiftlite.models.loader import load_tokenizer
        python = vllm_backend.find_python(args.vllm_python)
        ckpt = describe(ckpt_dir, model, **{k: v for k, v in overrides.items()
                                            if k in TEMPLATE_FIELDS + ("torch_dtype",)})
        served = "model" if ckpt.kind != "adapter" else "adapter"
        names = {served: ckpt.path} if ckpt.kind == "adapter" else {served: None}
        if ckpt.kind == "adapter":
            names["base"] = None
        workdir = tempfile.TemporaryDirectory(prefix="swiftlite-vllm-")
        files = vllm_backend.write_serving_files(ckpt, workdir.name, bool(args.trust_remote_code))
        port = _free_port()
        server_args = types.SimpleNamespace(
            host="127.0.0.1", port=port, max_batch_size=args.max_batch_size,
            tensor_parallel_size=args.tensor_parallel_size, max_model_len=args.max_model_len,
            trust_remote_code=args.trust_remote_code, vllm_args=args.vllm_args)
        cmd = vllm_backend.command(server_args, ckpt, names, files, python)
        env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
        info(f"starting vLLM (its log: {log_path})")
        log = open(log_path, "w", encoding="utf-8")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=vllm_backend.die_with_parent)
        log.close()
        tokenizer = load_tokenizer(ckpt.tokenizer_dir(), bool(args.trust_remote_code))
        template = ckpt.template_for(tokenizer)
        engine = cls(tokenizer, template, ckpt, proc, port, served, workdir)
        engine._wait_until_ready(log_path)
        return engine

    def _wait_until_ready(self, log_path: str) -> None:
        t0 = time.time()
        while time.time() - t0 < START_TIMEOUT_S:
            if self.proc.poll() is not None:
                self.unload()
                with open(log_path, encoding="utf-8", errors="replace") as f:
                    tail = f.read()[-3000:]
                raise UsageError(f"vLLM's server exited with status {self.proc.returncode} "
                                 f"before it was ready; the end of {log_path}:\n{tail}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                info(f"vLLM ready in {time.time() - t0:.0f} s")
                return
            except OSError:
                time.sleep(1)
        self.unload()
        raise UsageError(f"vLLM's server did not answer /health in {START_TIMEOUT_S} s; see "
                         f"{log_path}.")

    def unload(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._workdir.cleanup()

    def answer_batch(self, conversations: list, max_batch_size: int = 8, progress: bool = False,
                     **gen) -> list[Answer]:
        """The answers, in order: max_batch_size prompts per request, a few requests in flight
        so that vLLM's scheduler always has the next ones."""
        from tqdm import tqdm
        prompts = [self.encode(c) for c in conversations]
        body = self._sampling(gen)
        chunks = [list(range(i, min(i + max_batch_size, len(prompts))))
                  for i in range(0, len(prompts), max_batch_size)]
        answers: list[Answer | None] = [None] * len(prompts)
        bar = tqdm(total=len(prompts), desc="generating (vLLM)", unit="conv",
                   disable=not progress)

        def run(idx):
            out = self._complete({**body, "prompt": [prompts[i] for i in idx]})
            for choice in out["choices"]:
                answers[idx[choice["index"]]] = self._answer(choice)
            bar.update(len(idx))
        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(run, chunks))
        bar.close()
        return answers

    def _sampling(self, gen: dict) -> dict:
        """OpenAI/vLLM sampling fields equal to what the pt engine does with the same flags."""
        greedy = gen.get("do_sample") is False or not gen.get("temperature")
        body = {"model": self.served, "max_tokens": gen["max_new_tokens"],
                "temperature": 0.0 if greedy else gen["temperature"],
                "top_p": 1.0 if greedy else gen["top_p"], "return_token_ids": True,
                "repetition_penalty": gen["repetition_penalty"],
                "top_k": -1 if greedy or not gen["top_k"] else gen["top_k"]}
        if gen.get("seed") is not None:
            body["seed"] = gen["seed"]
        if self._stop_strings:
            body["stop"] = self._stop_strings
        return body

    def _complete(self, body: dict) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=3600) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise UsageError(f"vLLM refused the request ({e.code}): "
                             f"{e.read().decode(errors='replace')[:500]}") from None

    def _answer(self, choice: dict) -> Answer:
        ids = list(choice.get("token_ids") or [])
        if ids and ids[-1] in self._eos:
            ids = ids[:-1]
        text = choice["text"]
        stopped = choice["finish_reason"] == "stop"
        for w in self.template.stop_words:  # a stop word the detokenized text still holds
            if w and w in text:
                text, stopped = text[:text.index(w)], True
        return Answer(text, "stop" if stopped else "length", len(ids))
