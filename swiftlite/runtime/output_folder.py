"""A command's output folder, written as a whole: into a hidden temporary folder beside it,
renamed into place at the end, with a marker naming the command and the files it wrote.

The rule for a folder that is already there: only one that the same command wrote before
(its marker says so, and it holds nothing the marker does not list) may be replaced, and only
when the user asks (--exist_ok true). Anything else is refused before anything is written or
deleted: a folder of the user's, a model, a checkpoint, a folder another command wrote.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile

from swiftlite.errors import UsageError
from swiftlite.log import info

MARKER = ".swiftlite-output.json"


def refuse_unless_replaceable(out: str, command: str, exist_ok: bool, flag: str = "--output_dir"
                              ) -> None:
    """UsageError (exit 2) unless `out` is absent, or was written by `command` and
    --exist_ok is given; nothing is touched."""
    if not os.path.lexists(out):
        return
    if not os.path.isdir(out) or os.path.islink(out):
        raise UsageError(f"{flag} {out} exists and is not a folder; choose another {flag}.")
    written = written_by(out)
    if written != command:
        who = (f"`swiftlite {written}`" if written else "not swiftlite " + command)
        raise UsageError(f"{flag} {out} exists and was written by {who}: swiftlite {command} "
                         "replaces only a folder it wrote itself. Choose another "
                         f"{flag}, or remove that folder yourself.")
    extra = sorted(set(_files(out)) - set(_marker(out).get("files", [])) - {MARKER})
    if extra:
        shown = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        raise UsageError(f"{flag} {out} was written by swiftlite {command}, but now also holds "
                         f"{shown}, which it did not write; nothing was changed. Move those "
                         f"files away or choose another {flag}.")
    if not exist_ok:
        raise UsageError(f"{flag} {out} already exists (an earlier swiftlite {command}). Pass "
                         f"--exist_ok true to replace it, or choose another {flag}.")


def written_by(folder: str) -> str | None:
    """The command named by the folder's marker, or None."""
    command = _marker(folder).get("command")
    return command if isinstance(command, str) else None


def _marker(folder: str) -> dict:
    try:
        with open(os.path.join(folder, MARKER), encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _files(folder: str) -> list[str]:
    out = []
    for base, dirs, files in os.walk(folder):
        out += [os.path.relpath(os.path.join(base, f), folder) for f in files]
        out += [os.path.relpath(os.path.join(base, d), folder) + os.sep for d in dirs
                if not os.listdir(os.path.join(base, d))]
    return out


def write_marker(folder: str, command: str, **details) -> None:
    """The marker, listing every file now in `folder` (call it last, before finish())."""
    files = sorted(f for f in _files(folder) if f != MARKER)
    with open(os.path.join(folder, MARKER), "w", encoding="utf-8") as f:
        json.dump({"command": command, "files": files, **details}, f, indent=2,
                  ensure_ascii=False)


@contextlib.contextmanager
def writing(out: str, command: str):
    """Lock `out` against a second writer, sweep temporary folders that killed runs left, and
    yield a fresh temporary folder beside it (removed at the end unless finish() moved it)."""
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    with _lock(out, command):
        name = os.path.basename(out)
        for entry in os.listdir(parent):
            if entry.startswith((f".{name}.tmp-", f".{name}.old-")):
                info(f"removing {entry}, left by a swiftlite {command} into {name} that did "
                     "not finish")
                shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
        tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def finish(tmp: str, out: str) -> None:
    """Move the finished folder into place; an old one is removed only after that worked."""
    from swiftlite.runtime.output import fsync_tree
    fsync_tree(tmp)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary folder
    old = None
    if os.path.exists(out):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=os.path.dirname(out))
        os.rmdir(old)
        os.rename(out, old)
    os.rename(tmp, out)
    if old:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _lock(out: str, command: str):
    """One writer at a time: a lock file beside the folder (.<name>.lock), removed at the end
    (a killed run's stays, unlocked, and is reused)."""
    import fcntl
    path = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.lock")
    with open(path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            who = lock.read().strip() or "?"
            raise UsageError(f"another swiftlite {command} (pid {who}) is writing {out}; wait "
                             "for it to finish, or choose another --output_dir.") from None
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        try:
            yield
        finally:
            os.unlink(path)
