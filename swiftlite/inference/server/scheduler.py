"""The generation worker of the server: requests wait in a bounded queue and are generated in
dynamic batches by one thread that owns the model.

A batch takes the waiting jobs of one adapter (up to max_batch_size), prefills them together
(left padding), then decodes one token per step for every row. Each row samples with its own
settings and seeded generator, streams its text as it grows, and leaves the batch (its KV-cache
rows are dropped) when it stops, reaches max_tokens, or its client goes away; the batch ends
when no row is left. transformers' generate() cannot do per-row sampling settings or drop rows
mid-batch, hence this loop.
"""
from __future__ import annotations

import threading
import traceback
from dataclasses import dataclass, field
from typing import Callable

from swiftlite.log import warn


class QueueFull(Exception):
    pass


@dataclass
class Job:
    ids: list[int]
    max_tokens: int
    emit: Callable  # emit(kind, payload) from the worker thread: ("delta", str), ("done", dict)
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    adapter: str | None = None  # None: the base model
    cancelled: threading.Event = field(default_factory=threading.Event)


class Scheduler:
    def __init__(self, engine, max_batch_size: int = 8, max_queue_size: int = 64):
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.max_queue_size = max_queue_size
        self._waiting: list[Job] = []
        self._cond = threading.Condition()
        self._stop = False
        self.busy = 0  # jobs in the running batch
        self._thread = threading.Thread(target=self._work, daemon=True, name="swiftlite-deploy")
        self._thread.start()

    def submit(self, jobs: list[Job]) -> None:
        """Queue jobs together (a request's n choices), or raise QueueFull."""
        with self._cond:
            # A client that left while waiting frees its place at once.
            self._waiting = [j for j in self._waiting if not j.cancelled.is_set()]
            if len(self._waiting) + len(jobs) > self.max_queue_size:
                raise QueueFull()
            self._waiting += jobs
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()

    def _next_batch(self) -> list[Job]:
        with self._cond:
            while not self._waiting and not self._stop:
                self._cond.wait()
            if self._stop:
                return []
            adapter = self._waiting[0].adapter
            batch = [j for j in self._waiting if j.adapter == adapter][:self.max_batch_size]
            taken = set(map(id, batch))
            self._waiting = [j for j in self._waiting if id(j) not in taken]
            return batch

    def _work(self) -> None:
        while True:
            batch = [j for j in self._next_batch() if not j.cancelled.is_set()]
            if self._stop:
                return
            if not batch:
                continue
            self.busy = len(batch)
            try:
                self._generate(batch)
            except Exception:  # one failed batch answers 500 to its own requests only
                warn("generation failed:\n" + traceback.format_exc())
                for j in batch:
                    j.emit("error", "internal error while generating")
            finally:
                self.busy = 0

    def _generate(self, batch: list[Job]) -> None:
        import contextlib

        import torch
        from transformers import DynamicCache

        from swiftlite.inference.engine import _StopText
        eng = self.engine
        model, tok = eng.model, eng.tokenizer
        if batch[0].adapter is not None:
            model.set_adapter(batch[0].adapter)
            ctx = contextlib.nullcontext()
        else:
            ctx = model.disable_adapter() if hasattr(model, "disable_adapter") else \
                contextlib.nullcontext()
        width = max(len(j.ids) for j in batch)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        ids = torch.tensor([[pad] * (width - len(j.ids)) + j.ids for j in batch], device=eng.device)
        mask = torch.tensor([[0] * (width - len(j.ids)) + [1] * len(j.ids) for j in batch],
                            device=eng.device)
        gens = []
        for j in batch:
            g = torch.Generator(device="cpu")
            g.manual_seed(j.seed if j.seed is not None else torch.seed() % (2 ** 63))
            gens.append(g)
        cuts = [_StopText(j.stop + eng._stop_strings) for j in batch]
        tokens: list[list[int]] = [[] for _ in batch]
        sent = [""] * len(batch)
        live = list(range(len(batch)))
        cache = DynamicCache()
        kw = _forward_kwargs(model, cache)
        with torch.inference_mode(), ctx:
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, **kw)
            while live:
                logits = out.logits[:, -1, :].float()
                nxt, keep = [], []
                for row, i in enumerate(live):
                    j = batch[i]
                    if j.cancelled.is_set():
                        continue
                    t = _sample(logits[row], j.temperature, j.top_p, gens[i])
                    finish = None
                    if t in eng._eos:
                        finish = "stop"
                    else:
                        tokens[i].append(t)
                        text = tok.decode(tokens[i], skip_special_tokens=True)
                        if not text.endswith("\ufffd"):  # wait for the rest of a UTF-8 char
                            piece, stopped = cuts[i].feed(text[len(sent[i]):])
                            sent[i] = text
                            if piece:
                                j.emit("delta", piece)
                            if stopped:
                                finish = "stop"
                    if finish is None and len(tokens[i]) >= j.max_tokens:
                        finish = "length"
                    if finish is not None:
                        if finish == "length":
                            rest = cuts[i].flush()
                            if rest:
                                j.emit("delta", rest)
                        j.emit("done", {"finish_reason": finish,
                                        "completion_tokens": len(tokens[i]) + (t in eng._eos)})
                        continue
                    keep.append(row)
                    nxt.append(t)
                if not keep:
                    break
                if len(keep) < len(live):
                    index = torch.tensor(keep, device=eng.device)
                    cache.batch_select_indices(index)
                    mask, pos = mask[index], pos[index]
                    live = [live[r] for r in keep]
                mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
                pos = pos[:, -1:] + 1
                out = model(input_ids=torch.tensor([[t] for t in nxt], device=eng.device),
                            attention_mask=mask, position_ids=pos, **kw)
        for i in range(len(batch)):  # rows whose clients left: nothing more to say
            if batch[i].cancelled.is_set():
                batch[i].emit("done", {"finish_reason": "cancelled",
                                       "completion_tokens": len(tokens[i])})


def _forward_kwargs(model, cache) -> dict:
    """The KV cache under the name this transformers version takes, and logits of the last
    position only (a prefill's full logits would be batch x length x vocabulary floats)."""
    import inspect
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = inspect.signature(type(base).forward).parameters
    kw = {"cache" if "cache" in names else "past_key_values": cache, "use_cache": True}
    if "logits_to_keep" in names:
        kw["logits_to_keep"] = 1
    return kw


def _sample(logits, temperature: float, top_p: float, generator) -> int:
    import torch
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        cut = (sorted_p.cumsum(-1) - sorted_p) > top_p  # keep the smallest set reaching top_p
        sorted_p[cut] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))
