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
import hashlib
import json
import os
import re
import time

from swiftlite.runtime.atomic import replacing

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


def fsync_tree(folder: str, digests: dict | None = None) -> list[str]:
    """fsync every file under folder, then the folders themselves; the files, relative.
    `digests`, if given, gets each file's size and hash (file_digest), read as it is synced."""
    names = []
    for base, dirs, files in os.walk(folder):
        for name in files:
            path = os.path.join(base, name)
            rel = os.path.relpath(path, folder)
            with open(path, "rb") as f:
                if digests is not None:
                    digests[rel] = file_digest(f)
                os.fsync(f.fileno())
            names.append(rel)
    for base, dirs, _ in os.walk(folder, topdown=False):
        fd = os.open(base, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return sorted(names)


WHOLE_HASH_LIMIT = 256 * 2**20  # files up to this size are hashed whole
EDGE = 2**20  # of a larger one (full-model shards, a full fine-tune's optimizer): 1 MiB each end


def file_digest(f) -> dict:
    """{"size", and "blake2b" (the whole file) or "blake2b_ends" (its first and last MiB)}: a
    file cut short, lengthened or rewritten is caught; a larger file's middle is not hashed,
    so that marking and resuming a 100 GB checkpoint costs milliseconds, not minutes."""
    size = os.fstat(f.fileno()).st_size
    h = hashlib.blake2b(digest_size=16)
    f.seek(0)
    if size <= WHOLE_HASH_LIMIT:
        while chunk := f.read(2**22):
            h.update(chunk)
        return {"size": size, "blake2b": h.hexdigest()}
    h.update(f.read(EDGE))
    f.seek(size - EDGE)
    h.update(f.read(EDGE))
    return {"size": size, "blake2b_ends": h.hexdigest()}


def mark_complete(ckpt: str, step: int) -> None:
    """Write COMPLETE_MARKER once every file of the checkpoint is on disk, with each file's
    size and hash (damaged_files checks them before a resume loads anything)."""
    digests: dict = {}
    files = fsync_tree(ckpt, digests)
    with replacing(os.path.join(ckpt, COMPLETE_MARKER), fsync=True) as f:
        json.dump({"step": step, "files": files, "time": time.time(), "digests": digests}, f)
    fd = os.open(ckpt, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def damaged_files(ckpt: str) -> list[str]:
    """What is wrong with a complete checkpoint's files, one sentence each (empty: whole).
    Against the sizes and hashes its marker recorded; a marker written before they were (no
    "digests"; or an empty one, a user's word for a checkpoint older than markers) is trusted
    for the list of files (or the folder's), and each file is checked for being cut short as
    far as its format tells (safetensors' header, the zip directory of torch's files)."""
    try:
        with open(os.path.join(ckpt, COMPLETE_MARKER), encoding="utf-8") as f:
            text = f.read()
        marker = json.loads(text) if text.strip() else {}  # empty: a user vouched for it
        if not isinstance(marker, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        return [f"{COMPLETE_MARKER} is unreadable ({e})"]
    digests = marker.get("digests")
    problems = []
    listed = digests or marker.get("files") or [
        os.path.relpath(os.path.join(base, n), ckpt) for base, _, names in os.walk(ckpt)
        for n in names if n != COMPLETE_MARKER]
    for rel in listed:
        path = os.path.join(ckpt, rel)
        if not os.path.isfile(path):
            problems.append(f"{rel} is missing")
            continue
        if not digests:
            problems += [f"{rel} {p}" for p in [cut_short(path)] if p]
            continue
        want = digests[rel]
        with open(path, "rb") as f:
            got = file_digest(f)
        if got["size"] != want.get("size"):
            problems.append(f"{rel} has {got['size']:,} bytes, {want.get('size'):,} when it "
                            "was saved")
        elif got != want:
            problems.append(f"{rel} has changed since it was saved (its hash differs)")
    return problems


def cut_short(path: str) -> str | None:
    """Why a safetensors or torch (zip) file is visibly incomplete, or None."""
    size = os.path.getsize(path)
    try:
        if path.endswith(".safetensors"):
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n)) if 0 < n <= size - 8 else None
            if not isinstance(header, dict):
                return "is cut short (no complete safetensors header)"
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
                      default=0)
            if size != 8 + n + end:
                return f"has {size:,} bytes where its header describes {8 + n + end:,}"
        elif path.endswith((".pt", ".pth", ".bin")):
            import zipfile
            with open(path, "rb") as f:
                if f.read(2) != b"PK":  # not torch's zip format (an old pickle): not judged
                    return None
            with zipfile.ZipFile(path) as z:
                if any(i.header_offset + i.compress_size > size for i in z.infolist()):
                    return "is cut short"
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        return f"is unreadable ({type(e).__name__}: {e})"
    except Exception as e:  # zipfile.BadZipFile and the like
        return f"is cut short or damaged ({e})"
    return None
