"""Run folders: <output_dir>/v<N>-<YYYYMMDD-HHMMSS>, and complete checkpoints.

All processes of one run must agree on the folder. The process that launches the workers
(swiftlite's own relaunch under torchrun) claims it and passes it in SWIFTLITE_RUN_DIR.
Claiming is atomic: two runs started at once into one output_dir get two version numbers.

A checkpoint-<step> folder is complete once COMPLETE_MARKER is in it, written after every file
of the checkpoint is on disk (fsync); a folder without it was being written when its run
stopped, and is never resumed or returned as a run's last checkpoint.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import time

RUN_DIR_ENV = "SWIFTLITE_RUN_DIR"
COMPLETE_MARKER = "swiftlite-complete.json"


def next_run_dir(output_dir: str) -> str:
    existing = [int(m.group(1)) for d in (os.listdir(output_dir) if os.path.isdir(output_dir)
                                          else []) if (m := re.match(r"v(\d+)-", d))]
    n = max(existing) + 1 if existing else 0
    return os.path.join(output_dir, f"v{n}-{time.strftime('%Y%m%d-%H%M%S')}")


def claim_run_dir(output_dir: str) -> str:
    """Create a new v<N>-<timestamp> folder under output_dir and return it. The version is
    chosen and the folder made under a lock in output_dir, and mkdir itself fails rather than
    reuse a folder, so concurrent runs (a sweep started with `&`) never share one."""
    if not os.path.isdir(output_dir):
        os.makedirs(output_dir, exist_ok=True)
        _MADE_ROOTS.add(os.path.abspath(output_dir))
    fd = os.open(output_dir, os.O_RDONLY)  # the lock is on the folder itself: no lock file
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        while True:
            path = next_run_dir(output_dir)
            try:
                os.mkdir(path)
                return path
            except FileExistsError:  # made by a process that does not take the lock
                time.sleep(0.01)
    finally:
        os.close(fd)  # releases the lock


_MADE_ROOTS: set[str] = set()  # output_dirs claim_run_dir created in this process


def remove_if_empty(run_dir: str) -> None:
    """A claimed run folder that a failed start left empty goes again (and the output_dir,
    if claiming made it and it is empty now)."""
    for folder in (run_dir, os.path.dirname(os.path.abspath(run_dir))):
        if folder != run_dir and folder not in _MADE_ROOTS:
            break
        try:
            os.rmdir(folder)  # fails unless empty
        except OSError:
            break


def create_run_dir(run_dir: str) -> str:
    os.makedirs(run_dir, exist_ok=True)
    return run_dir


RUN_FILES = ("args.json", "logging.jsonl", "metrics.json")


def other_run_files(folder: str) -> list[str]:
    """What in `folder` shows that a run already wrote there."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(n for n in names if n in RUN_FILES or re.fullmatch(r"checkpoint-\d+", n))


def checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """(step, path) of the checkpoint-<step> folders directly inside run_dir, by step."""
    try:
        names = os.listdir(run_dir)
    except OSError:
        return []
    return sorted((int(m.group(1)), os.path.join(run_dir, n)) for n in names
                  if (m := re.fullmatch(r"checkpoint-(\d+)", n)))


def is_complete(ckpt: str) -> bool:
    return os.path.isfile(os.path.join(ckpt, COMPLETE_MARKER))


def last_checkpoint(run_dir: str) -> str | None:
    """The highest-step complete checkpoint inside run_dir (None: none, or no such folder)."""
    done = [path for _, path in checkpoints(run_dir) if is_complete(path)]
    return done[-1] if done else None


def fsync_tree(folder: str) -> list[str]:
    """fsync every file under folder, then the folders themselves; the files, relative."""
    names = []
    for base, dirs, files in os.walk(folder):
        for name in files:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            names.append(os.path.relpath(path, folder))
    for base, dirs, _ in os.walk(folder, topdown=False):
        fd = os.open(base, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return sorted(names)


def mark_complete(ckpt: str, step: int) -> None:
    """Write COMPLETE_MARKER once every file of the checkpoint is on disk."""
    files = fsync_tree(ckpt)
    tmp = os.path.join(ckpt, f".{COMPLETE_MARKER}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"step": step, "files": files, "time": time.time()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(ckpt, COMPLETE_MARKER))
    fd = os.open(ckpt, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
