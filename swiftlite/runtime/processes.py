"""Ending a whole process tree: a run and every process it started.

torchrun starts each worker in a session of its own, so signalling the run's process group
reaches swiftlite and torchrun but not the workers; and a launcher killed before it has
ended its workers leaves them running, holding memory and devices. So a tree is ended by its
members, found while they still hang together: each is asked to stop (SIGINT, which the
Trainer and torchrun handle by unwinding), then told (SIGTERM), then killed, and the tree
counts as ended only when every member is gone.
"""
from __future__ import annotations

import signal
import time

STEPS = ((signal.SIGINT, 15.0), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0))


def tree(pid: int, create_time: float | None = None) -> list:
    """The process `pid` (if it is still the one started at create_time) and its
    descendants, as psutil.Process objects (which tell a reused pid from the original)."""
    import psutil
    try:
        root = psutil.Process(pid)
        if create_time is not None and abs(root.create_time() - create_time) > 1:
            return []
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def records(procs: list) -> list[list]:
    """[pid, start time] of each process, to write down (e.g. in a JSON state file)."""
    return [[p.pid, t] for p in procs if (t := _created(p)) is not None]


def from_records(recs: list) -> list:
    """The processes of records() that are still the ones recorded (not a reused pid)."""
    import psutil
    out = []
    for pid, created in recs:
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - created) < 1:
                out.append(p)
        except psutil.Error:
            pass
    return out


def running(procs: list) -> list:
    """Members still running (a zombie has ended: it only waits for its parent to read it)."""
    import psutil
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


def grow(procs: list) -> list:
    """procs plus any descendants started since (a worker restarted meanwhile)."""
    import psutil
    seen = {(p.pid, _created(p)) for p in procs}
    out = list(procs)
    for p in running(procs):
        try:
            for c in p.children(recursive=True):
                if (c.pid, _created(c)) not in seen:
                    seen.add((c.pid, _created(c)))
                    out.append(c)
        except psutil.Error:
            pass
    return out


def _created(p) -> float | None:
    try:
        return p.create_time()
    except Exception:
        return None


def end_tree(procs: list, steps=STEPS) -> bool:
    """Signal every running member, step by step, until none is left; True when all ended.
    (After a Ctrl-C torchrun may get SIGINT twice, from the terminal and from here: it then
    stops ending its workers, which the next steps do.)"""
    import psutil
    for sig, wait_s in steps:
        procs = grow(procs)
        alive = running(procs)
        if not alive:
            return True
        for p in alive:
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass
        deadline = time.time() + wait_s
        while time.time() < deadline and running(procs):
            time.sleep(0.1)
    return not running(procs)
