"""Run folders: <output_dir>/v<N>-<YYYYMMDD-HHMMSS>.

All processes of one run must agree on the folder. The process that launches the workers
(swiftlite's own relaunch under torchrun) picks it and passes it in SWIFTLITE_RUN_DIR.
"""
from __future__ import annotations

import os
import re
import time

RUN_DIR_ENV = "SWIFTLITE_RUN_DIR"


def next_run_dir(output_dir: str) -> str:
    existing = [int(m.group(1)) for d in (os.listdir(output_dir) if os.path.isdir(output_dir)
                                          else []) if (m := re.match(r"v(\d+)-", d))]
    n = max(existing) + 1 if existing else 0
    return os.path.join(output_dir, f"v{n}-{time.strftime('%Y%m%d-%H%M%S')}")


def create_run_dir(run_dir: str) -> str:
    os.makedirs(run_dir, exist_ok=True)
    return run_dir


def last_checkpoint(run_dir: str) -> str | None:
    """The highest-step checkpoint-<step> folder directly inside run_dir (None: none, or no
    such folder)."""
    try:
        steps = [(int(m.group(1)), name) for name in os.listdir(run_dir)
                 if (m := re.fullmatch(r"checkpoint-(\d+)", name))]
    except OSError:
        return None
    return os.path.join(run_dir, max(steps)[1]) if steps else None
