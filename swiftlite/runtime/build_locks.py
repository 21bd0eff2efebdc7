"""Build locks that a killed process left behind (torch's just-in-time C++ extensions).

torch compiles a C++ extension (DeepSpeed's CPU Adam; the shared-memory all-reduce of its CPU
accelerator) under a lock file in the extension's build folder, `lock`, and removes the file
when the build ends. Another process that wants the extension meanwhile polls until the file
is gone, with no time limit and no message. A builder killed before it removes the file
(SIGKILL, the kernel's OOM killer, a CI job's timeout, torchrun ending the other ranks when
one fails) leaves the file for good, and every later run that needs the extension waits
forever at its start, printing nothing.

A live builder holds the lock file open from creating it to removing it (torch's FileBaton
keeps the descriptor of its O_EXCL create), so a lock that no process has open was left by a
build that will never finish. `clear_stale` removes those, and says which it removed. Linux
only (it reads /proc); elsewhere it does nothing.
"""
from __future__ import annotations

import glob
import os
import time

from swiftlite.log import warn


def extensions_root() -> str:
    """Where torch builds its extensions: each in $TORCH_EXTENSIONS_DIR/NAME when that is set,
    else in $XDG_CACHE_HOME (~/.cache)/torch_extensions/pyXY_ACCELERATOR/NAME (torch's
    cpp_extension._get_build_directory; read here without importing torch)."""
    return os.path.realpath(os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torch_extensions"))


def _held(paths: set[str]) -> set[str]:
    """Which of `paths` some process has open, among the processes this one may inspect
    (another user's are hidden from it, and do not build in this user's cache)."""
    held = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target in paths:
                held.add(target)
    return held


def clear_stale(root: str | None = None, settle_s: float = 0.5) -> list[str]:
    """Remove the extension build locks under `root` (default: extensions_root()) that no
    process holds open; returns their paths. A lock is looked at twice, `settle_s` apart:
    a builder closes its descriptor a moment before it removes the file itself."""
    if not os.path.isdir("/proc/self/fd"):
        return []
    root = root or extensions_root()
    locks = {os.path.realpath(p) for depth in ("*", "*/*")
             for p in glob.glob(os.path.join(root, depth, "lock"))}
    if not locks:
        return []
    unheld = locks - _held(locks)
    if unheld:
        time.sleep(settle_s)
        unheld = {p for p in unheld if os.path.exists(p)} - _held(unheld)
    removed = []
    for path in sorted(unheld):
        try:
            os.remove(path)
        except FileNotFoundError:  # another rank cleared it first
            continue
        removed.append(path)
        warn(f"removed {path}: a build of the C++ extension "
             f"{os.path.basename(os.path.dirname(path))!r} was killed before it finished and "
             "left its lock, and no process holds it, so the build will run again")
    return removed
