"""Running swiftlite as a user would, and the small chat set most tests train on."""
from __future__ import annotations

import json
import locale
import os
import shutil
import subprocess
import sys
import tempfile

from helpers import warm_start

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
    """Run `swiftlite ...` as a user would (a child process, forked from a warm interpreter
    where it can be: helpers/warm_start.py); returns CompletedProcess."""
    full_env = {**os.environ, **(env or {})}
    r = _warm(list(map(str, args)), env or {}, cwd, timeout)
    r = r or subprocess.run([sys.executable, "-m", "swiftlite.cli", *map(str, args)],
                            capture_output=True, text=True, env=full_env, cwd=cwd, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"swiftlite {' '.join(map(str, args))} exited {r.returncode}\n"
                             f"--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-8000:]}")
    return r


def _warm(args: list[str], env: dict, cwd, timeout) -> subprocess.CompletedProcess | None:
    """The run forked from a warm interpreter (helpers/warm_start.py), or None where it cannot."""
    with tempfile.TemporaryDirectory(prefix="swiftlite-cli-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        rc = warm_start.run(args, env, cwd, timeout, out, err)
        if rc is None:
            return None
        encoding = locale.getpreferredencoding(False)  # subprocess.run's text=True
        with open(out, encoding=encoding) as o, open(err, encoding=encoding) as e:
            return subprocess.CompletedProcess([sys.executable, "-m", "swiftlite.cli", *args], rc,
                                               o.read(), e.read())


def copy_run(run_dir, dest) -> None:
    """A private copy of a session's run folder, without the *-merged folders (and their
    temporary ones) that merge tests on another worker may be writing into it meanwhile."""
    shutil.copytree(run_dir, dest, ignore=shutil.ignore_patterns("*-merged*"))
