"""Build locks that a killed process left behind (torch's just-in-time C++ extensions).

torch compiles a C++ extension (DeepSpeed's CPU Adam; the shared-memory all-reduce of its CPU
accelerator) under a lock file in the extension's build folder, `lock`, and removes the file
when the build ends. Another process that wants the extension meanwhile polls until the file
is gone, with no time limit and no message. A builder killed before it removes the file
(SIGKILL, the kernel's OOM killer, a CI job's timeout, torchrun ending the other ranks when
one fails) leaves the file for good, and every later run that needs the extension waits
forever at its start, printing nothing.

A live builder holds the lock file open from creating it to removing it (torch's FileBaton
keeps the descriptor of its O_EXCL create), so on a local filesystem a lock that no process
has open was left by a build that will never finish. On a filesystem that other machines may
share (NFS, Lustre, a FUSE mount: anything not known to be local) the builder may be a rank
on another node, invisible here: such a lock is waited for until it is gone or older than
any build takes (SHARED_STALE_S), and only then taken as stale. `clear_stale` removes the
stale locks and says which. Linux only (it reads /proc); elsewhere it does nothing.
"""
from __future__ import annotations

import glob
import os
import re
import time

from swiftlite.log import info, warn

LOCAL_FILESYSTEMS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "f2fs",
                     "ramfs", "bcachefs"}
# DeepSpeed's CPU ops build in about a minute on 2 cores; ten leaves room for a loaded node.
SHARED_STALE_S = 600.0


def extensions_root() -> str:
    """Where torch builds its extensions: each in $TORCH_EXTENSIONS_DIR/NAME when that is set,
    else in $XDG_CACHE_HOME (~/.cache)/torch_extensions/pyXY_ACCELERATOR/NAME (torch's
    cpp_extension._get_build_directory; read here without importing torch)."""
    return os.path.realpath(os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torch_extensions"))


def filesystem(path: str) -> str:
    """The type of the filesystem `path` is on (its mount in /proc/self/mountinfo), or ""."""
    best, kind = "", ""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)),
                               left.split()[4])  # mountinfo writes a space as \040
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, right.split()[0]
    except (OSError, IndexError):
        return ""
    return kind


def _held(paths: set[str]) -> set[str]:
    """Which of `paths` some process on this machine has open, among the processes this one
    may inspect (another user's are hidden from it, and do not build in this user's cache)."""
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


def _age(path: str) -> float | None:
    try:
        return time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return None


def _await_shared(path: str, kind: str, stale_s: float) -> bool:
    """Wait while an unheld lock on a shared filesystem is young: True when it is stale."""
    age = _age(path)
    if age is not None and age < stale_s:
        info(f"waiting for {path}: a build of {os.path.basename(os.path.dirname(path))!r} "
             f"began {age:.0f} s ago on this {kind} filesystem, by no process of this machine "
             f"(another node's, or a killed one); it counts as stale at {stale_s / 60:.0f} min")
    while age is not None and age < stale_s:
        time.sleep(min(2.0, stale_s - age))
        age = _age(path)
    return age is not None


def clear_stale(root: str | None = None, settle_s: float = 0.5,
                shared_stale_s: float = SHARED_STALE_S) -> list[str]:
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
        kind = filesystem(path)
        if kind not in LOCAL_FILESYSTEMS and not _await_shared(path, kind or "unknown",
                                                               shared_stale_s):
            continue  # its builder on another node finished
        try:
            os.remove(path)
        except FileNotFoundError:  # another rank cleared it first
            continue
        removed.append(path)
        warn(f"removed {path}: a build of the C++ extension "
             f"{os.path.basename(os.path.dirname(path))!r} was killed before it finished and "
             "left its lock, and no process holds it, so the build will run again")
    return removed
