"""Shared fixtures: the real models (built once into the swiftlite cache), trained checkpoints
made once per session and reused by the merge/infer/deploy/eval/export tests, and the libraries
kept resident for the suite's child processes. Helpers the tests import live in helpers/.

Layout: unit/ tests run in this process (functions, layers, tiny models); e2e/ tests drive
swiftlite as a user does (the CLI, a server, a browser, several processes). The tiers are marks:
`pytest -m "not slow"` is the inner loop."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
from filelock import FileLock

# Under pytest-xdist (scripts/test.sh: two workers on two cores) each worker, and everything it
# starts, computes on one thread, and vLLM's CPU server binds its thread to the worker's own
# core: two workers of two OpenMP threads each spin-wait on each other (measured: a 30 s
# SmolLM2 DPO test took 305 s, the whole suite 1.08x longer than one worker).
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    _cores = sorted(os.sched_getaffinity(0))
    _worker = int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw") or 0)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(_cores[_worker % len(_cores)]))
from helpers.cli import CHAT_ROWS, REPO, run_cli, write_jsonl  # noqa: E402
from helpers.marks import VLLM_PYTHON  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("WANDB_DISABLED", "true")
# The venv's tools first, as in an activated venv: DeepSpeed JIT-builds its CPU ops with the
# `ninja` it finds on PATH, and the venv's (1.13) and Debian's (1.11) log a command under
# different hashes, so tests alternating between them rebuilt CPU Adam (70-90 s) each time.
_BIN = os.path.dirname(sys.executable)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _BIN:
    os.environ["PATH"] = _BIN + os.pathsep + os.environ.get("PATH", "")


def once(tmp_path_factory, name: str, make):
    """A session fixture's value made once for the whole run: under pytest-xdist (`-n 2`) the
    first worker to ask makes it and the others wait for it and reuse it, instead of training the
    same checkpoint once per worker. The value must pickle; make() writes under tmp_path_factory."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return make()
    shared = tmp_path_factory.getbasetemp().parent / f"{name}.pickle"  # the run's, not a worker's
    with FileLock(f"{shared}.lock"):
        if shared.exists():
            return pickle.loads(shared.read_bytes())
        value = make()
        shared.write_bytes(pickle.dumps(value))
        return value


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
    return once(tmp_path_factory, "tiny_run", lambda: swiftlite.sft(
        model="tiny-qwen2", dataset=[chat_jsonl + "#32"], max_steps=8,
        per_device_train_batch_size=4, gradient_accumulation_steps=1,
        learning_rate=2e-2, save_steps=4, logging_steps=1,
        # fp32 even on a bf16 CPU: the merge tests check logits to 1e-4
        torch_dtype="float32",
        output_dir=str(tmp_path_factory.mktemp("tiny_run"))))  # default report_to: tensorboard (runs/)


# -- libraries kept in memory for the suite's child processes (see resident_libraries.py) ---------
RESIDENT = {
    sys.executable: ("torch", "transformers", "peft", "datasets", "accelerate", "deepspeed",
                     "transformers.trainer", "gradio", "swiftlite.cli"),
}


_helpers: list[subprocess.Popen] = []


def pytest_sessionstart(session):
    """One helper per venv holding the libraries that the suite's child processes import
    (vLLM's venv too, when there is one), started once per run: by pytest-xdist's controller,
    before it starts the workers, or by plain pytest. They end with the run."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    venvs = dict(RESIDENT)
    if os.path.exists(VLLM_PYTHON):
        venvs[VLLM_PYTHON] = ("vllm.entrypoints.openai.api_server", "vllm.v1.engine.core",
                              "vllm.v1.executor.multiproc_executor", "vllm.v1.worker.cpu_worker")
    log = open(session.config._tmp_path_factory.getbasetemp() / "resident_libraries.log", "w")
    _helpers.extend(subprocess.Popen([python, os.path.join(REPO, "tests", "helpers",
                                                           "resident_libraries.py"), *modules],
                                     stdout=subprocess.PIPE, stderr=log, text=True)
                    for python, modules in venvs.items())
    # Wait until they hold their files (about 20 s): importing next to a test would take CPU
    # from its two OpenMP threads, which then wait for each other.
    for helper in _helpers:
        for line in helper.stdout:  # libraries print to stdout too; the helper's line ends it
            log.write(line)
            if line.startswith("resident_libraries:"):
                break
    log.close()


def pytest_sessionfinish(session):
    for helper in _helpers:
        helper.kill()
        helper.wait()


# -- the order the two workers take the files in -------------------------------------------------
# The files that take longest, longest first (measured with --durations; scripts/test.sh passes
# --no-loadscope-reorder so that pytest-xdist hands files out in this order): the suite then ends
# on short files on both workers, instead of one finishing a long file alone. The rest follow in
# collection order.
LONGEST_FIRST = (
    "test_deepspeed.py", "test_rlhf.py", "test_export.py", "test_tool_calling.py",
    "test_webui_browser.py", "test_eval.py", "test_allocator.py", "test_deploy_logprobs.py",
    "test_deploy_vllm.py", "test_deploy.py", "test_reliability.py", "test_merge.py",
    "test_infer.py", "test_qlora.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole


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
    return once(tmp_path_factory, "smollm2_cognition", lambda: _train_cognition(tmp_path_factory))


def _train_cognition(tmp_path_factory) -> dict:
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
def smollm2_merged(tmp_path_factory, smollm2_cognition):
    """Swifty merged into SmolLM2: (folder, merge-lora's stdout)."""
    ckpt = smollm2_cognition["Swifty"]
    return once(tmp_path_factory, "smollm2_merged",
                lambda: (ckpt + "-merged", run_cli("merge-lora", "--ckpt_dir", ckpt).stdout))
