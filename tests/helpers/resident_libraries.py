"""Keep a venv's libraries in memory while the test suite runs (started by conftest.py).

The suite starts about seventy Python processes (the CLI, torchrun and DeepSpeed ranks, the
servers, vLLM's three processes per server), each importing torch and friends. On hosts whose
kernel pages out memory idle for a minute (these machines run DAMON's `pageout` scheme), every
one of them read torch's libraries from disk again: `import torch` took 5-6 s wall for 1.5 s of
CPU, vLLM's server module 24 s for 8 s. This helper imports the modules named on its command
line, then holds every file they mapped (shared libraries) and every .pyc they read in memory:
locked with mlockall where the process may lock memory, else touched every 20 s so that no page
counts as idle. It exits when its parent (pytest) does.

  python tests/helpers/resident_libraries.py torch transformers peft
"""
from __future__ import annotations

import ctypes
import importlib
import mmap
import os
import sys
import time

MCL_CURRENT = 1
PAGE = mmap.PAGESIZE


def _map(paths) -> list[mmap.mmap]:
    """Read-only maps of the files at `paths` that can be opened and are not empty."""
    maps = []
    for path in paths:
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size:
                    maps.append(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
        except (OSError, TypeError, ValueError):
            continue
    return maps


def _compiled_modules() -> list[str]:
    """The .pyc files of every module imported so far."""
    # vars(), not getattr: lazy modules import on attribute access
    return [p for p in (vars(m).get("__cached__") for m in list(sys.modules.values())) if p]


def _shared_libraries() -> list[str]:
    """The shared libraries this process has loaded."""
    paths = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].strip().startswith("/") and ".so" in parts[5]:
                paths.add(parts[5].strip())
    return sorted(paths)


def _touch(maps) -> None:
    for m in maps:
        for offset in range(0, len(m), PAGE):
            m[offset]


def main() -> None:
    parent = os.getppid()
    for name in sys.argv[1:]:
        try:
            importlib.import_module(name)
        except Exception as e:  # a missing optional package: hold the rest
            print(f"resident_libraries: {name}: {e}", file=sys.stderr)
    maps = _map(_shared_libraries() + _compiled_modules())
    _touch(maps)
    locked = ctypes.CDLL(None, use_errno=True).mlockall(MCL_CURRENT) == 0
    size = sum(len(m) for m in maps) >> 20
    print(f"resident_libraries: {len(maps)} files, {size} MB "
          f"{'locked' if locked else 'touched every 20 s (mlockall not permitted)'}", flush=True)
    while os.getppid() == parent:
        time.sleep(2 if locked else 20)
        if not locked:
            _touch(maps)


if __name__ == "__main__":
    main()
