"""Build locks that a killed process left behind (torch's just-in-time C++ extensions).

torch compiles a C++ extension (DeepSpeed's CPU Adam) under a lock file in the extension's
build folder, `lock`, and removes the file when the build ends. Another process that wants the
extension meanwhile polls until the file is gone, with no time limit and no message. A builder
killed before it removes the file (SIGKILL, the kernel's OOM killer, a CI job's timeout,
torchrun ending the other ranks when one fails) leaves the file for good, and every later run
that needs the extension waits forever at its start, printing nothing.

A live builder holds the lock file open from creating it to removing it (torch's FileBaton
keeps the descriptor of its O_EXCL create), so a lock that no process of this machine has open,
on a local filesystem and created by this user, was left by a build that will never finish:
`clear_stale` removes it and says so. Where the builder could be invisible here (a filesystem
that other machines may share: NFS, Lustre, FUSE, anything not known to be local; or another
user's lock) it removes nothing and says which file the run will wait for and when to delete
it. Only the ops swiftlite's runs build are looked at. Linux only (it reads /proc).
"""
from __future__ import annotations

import glob
import os
import re
import time

from swiftlite.log import warn

# What DeepSpeed compiles for swiftlite's runs: CPU Adam (ZeRO offload). Its shared-memory
# all-reduce is never loaded (training/deepspeed.py: _no_shm_all_reduce).
DEEPSPEED_OPS = ("cpu_adam",)
LOCAL_FILESYSTEMS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "f2fs",
                     "ramfs", "bcachefs"}


def extensions_root() -> str:
    """Where torch builds its extensions: each in $TORCH_EXTENSIONS_DIR/NAME when that is set
    (even empty), else in $XDG_CACHE_HOME (~/.cache)/torch_extensions/pyXY_ACCELERATOR/NAME
    (torch's cpp_extension._get_build_directory; read here without importing torch)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        root = os.path.join(os.getenv("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                            "torch_extensions")
    return os.path.realpath(root)


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
    """Which of `paths` some process of this machine has open, among those this one may
    inspect (the caller leaves other users' locks alone)."""
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


def _why_kept(path: str) -> str | None:
    """Why a lock that no process here holds may still be live (None: it is not)."""
    try:
        owner = os.stat(path).st_uid
    except FileNotFoundError:
        return None
    if owner != os.getuid():
        return f"it belongs to user id {owner}, whose builds this process cannot see"
    kind = filesystem(path)
    if kind not in LOCAL_FILESYSTEMS:
        return (f"it is on a {kind or 'unknown'} filesystem that other machines may share, "
                "whose builds this machine cannot see")
    return None


def clear_stale(root: str | None = None, names: tuple[str, ...] = DEEPSPEED_OPS,
                settle_s: float = 0.5) -> list[str]:
    """Remove the build locks of the extensions `names` under `root` (default:
    extensions_root()) that no process holds open; returns their paths. A lock is looked at
    three times, `settle_s` apart: a builder closes its descriptor a moment before it removes
    the file itself."""
    if not os.path.isdir("/proc/self/fd"):
        return []
    root = root or extensions_root()
    locks = {os.path.realpath(p) for name in names for depth in ("", "*")
             for p in glob.glob(os.path.join(root, depth, name, "lock"))}
    for look in range(3):
        if look:
            time.sleep(settle_s)
        locks = {p for p in locks if os.path.exists(p)} - _held(locks)
        if not locks:
            return []
    removed = []
    for path in sorted(locks):
        name = os.path.basename(os.path.dirname(path))
        why = _why_kept(path)
        if why:
            warn(f"the build of the C++ extension {name!r} is locked by {path}, which no process "
                 f"of this machine holds, but {why}: this run waits for it. If no build of "
                 f"{name!r} is running anywhere, delete that file.")
            continue
        try:
            os.remove(path)
        except FileNotFoundError:  # another rank cleared it first
            continue
        except OSError as e:
            warn(f"{path} is a build lock left by a killed build of {name!r}, and it could not "
                 f"be removed ({e.strerror}): this run waits for it. Delete that file.")
            continue
        removed.append(path)
        warn(f"removed {path}: a build of the C++ extension {name!r} was killed before it "
             "finished and left its lock, and no process holds it, so the build will run again")
    return removed
