"""Files written whole or not at all: a reader (another process, a later start, a resume) finds
the old file or the new one, never half of one. The content goes to a file beside the target,
named after this process and thread (runs, Web-UI threads and ranks write side by side), which
then replaces the target (os.replace: one step within a file system); a write that fails
leaves nothing behind."""
from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterable


@contextlib.contextmanager
def replacing(path: str, mode: str = "w", fsync: bool = False):
    """A file to write path's new content to, which replaces path when the block ends without
    an error. fsync: the content is on disk before it replaces path (after a crash: the old
    file or the new one, not an empty one)."""
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        with open(tmp, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_json(path: str, obj, **dump_args) -> None:
    with replacing(path) as f:
        json.dump(obj, f, **{"ensure_ascii": False, **dump_args})


def write_lines(path: str, lines: Iterable[str]) -> None:
    """One line per item (each without its newline)."""
    with replacing(path) as f:
        for line in lines:
            f.write(line + "\n")
