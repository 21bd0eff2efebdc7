"""Running swiftlite as a user would, and the small chat set most tests train on."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


def copy_run(run_dir, dest) -> None:
    """A private copy of a session's run folder, without the *-merged folders (and their
    temporary ones) that merge tests on another worker may be writing into it meanwhile."""
    shutil.copytree(run_dir, dest, ignore=shutil.ignore_patterns("*-merged*"))
