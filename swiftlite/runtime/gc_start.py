"""Python's cyclic garbage collector during a command's start (#42).

A start imports torch, transformers, peft and their kin: hundreds of thousands of objects that
live as long as the process. Python runs a full collection, which scans every one of them,
whenever the long-lived objects have grown by a quarter since the last; so a start paid for a
series of full collections, each longer than the one before, and a training run for one every
few steps afterwards, each finding next to nothing to free (figures in docs/performance.md).
Young objects, where garbage cycles are, are collected all along.

So the command's own process (cli.main) holds full collections back while it starts, and
`release` lets them run again when the start is over: before the first training step, once
infer's model or deploy's server is ready. Those processes also freeze what they hold then
(model, data, trainer, engine: kept to the end) out of later collections' reach, without a
collection first (it found next to nothing to free, at the price of one full scan). eval, which
loads and unloads models (each unload collecting), merge-lora and export hold full collections
back to their end. Python API callers keep their own collector settings.
"""
from __future__ import annotations

import gc

_held: tuple[int, int, int] | None = None  # the thresholds to restore
_froze = False  # release(freeze=True) froze this process' objects (not a Python caller)


def hold() -> None:
    """No full collections until release(); young ones as usual."""
    global _held
    if _held is None:
        _held = gc.get_threshold()
        gc.set_threshold(_held[0], _held[1], 10**9)


def release(freeze: bool = False) -> None:
    """Full collections as before hold(). freeze: this process keeps what it holds now to its
    end; leave those objects out of every later collection."""
    global _held, _froze
    if _held is None:
        return
    gc.set_threshold(*_held)
    _held = None
    if freeze:
        gc.freeze()
        _froze = True


def unfreeze() -> None:
    """Objects frozen by release(freeze=True) can be freed by a collection again (the run is
    dropping its model: an out-of-memory error). A Python caller's own freeze stays."""
    global _froze
    if _froze:
        gc.unfreeze()
        _froze = False
