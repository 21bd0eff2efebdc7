"""What a forward pass keeps for gradient checkpointing's recompute, and how the recompute
knows it is its own (keep_attention.py, fused_lora.py).

Checkpointing runs a decoder layer again inside backward; values kept from the forward pass
(attention's output, frozen matmul outputs, drop positions) let it skip work. Each is kept on
its module, one per forward, and handed over when the recompute asks. A recompute must take
only what its own forward kept: two forwards with gradients and then the first one's backward
(or a forward that is never back-propagated) would otherwise hand it another batch's values,
silently wrong gradients. The recompute's input is its forward's, bit for bit, so a few of its
values, spread across it, tell its own kept values from another forward's. Records are kept
per thread: with --batch_threads each part of a batch runs its forward and recompute in a
thread of its own, through the same modules.
"""
from __future__ import annotations

import threading
import weakref

import torch

_local = threading.local()

_SAMPLES = 16


def checkpointing(block) -> bool:
    """Whether decoder layer `block` (None: none) runs under gradient checkpointing now, in
    training and with gradients: only then does a recompute come for what its forward keeps."""
    return (block is not None and block.gradient_checkpointing and block.training
            and torch.is_grad_enabled())


def recomputing() -> bool:
    """Whether this runs inside backward (a graph task is running): checkpointing's recompute."""
    return torch._C._current_graph_task_id() != -1


def fingerprint(t: torch.Tensor) -> tuple:
    """t's shape and a few of its values, strided across it, as Python numbers: the recompute
    runs the same operators as the forward (torch's selective checkpointing counts them)."""
    flat = t.detach().reshape(-1)
    return tuple(t.shape), flat[::max(1, flat.numel() // _SAMPLES)].tolist()


def same(kept: tuple, t: torch.Tensor) -> bool:
    """Whether `t` is the tensor whose fingerprint was `kept`."""
    return fingerprint(t) == kept


def keep(module, record) -> None:
    """Keep `record` for `module`'s next recompute in this thread (None: nothing kept)."""
    records = getattr(_local, "records", None)
    if records is None:
        records = _local.records = weakref.WeakKeyDictionary()
    if record is None:
        records.pop(module, None)
    else:
        records[module] = record


def take(module):
    """What `module`'s forward in this thread kept (None: nothing), handed over once."""
    records = getattr(_local, "records", None)
    return None if records is None else records.pop(module, None)


def kept(module):
    """What `module` keeps in this thread now, left in place."""
    records = getattr(_local, "records", None)
    return None if records is None else records.get(module)
