"""Shared fixtures: the real models (built once into the swiftlite cache) and a small
trained tiny-qwen2 checkpoint reused by the merge/infer/web-ui tests."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("WANDB_DISABLED", "true")

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
