"""swiftlite deploy's scheduler on the real tiny-qwen2, in this process: a job that fails (its
seed, its sampling, its prefill) is answered "error" alone; the jobs beside it in the batch
give the answer they give alone, and every job taken from the queue is answered. The API
refuses these settings first (seed range, NaN temperature); this is the second wall."""
from __future__ import annotations

import threading

import pytest

from swiftlite.inference.server.scheduler import Job, Scheduler

HI = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def engine(tiny_qwen2):
    from swiftlite.inference.engine import InferEngine
    engine = InferEngine.load(model="tiny-qwen2", torch_dtype="float32")
    yield engine
    engine.unload()


@pytest.fixture(scope="module")
def scheduler(engine):
    s = Scheduler(engine, max_batch_size=8)
    yield s
    s.close()


class Listener:
    """A job's events as the worker thread emits them."""

    def __init__(self):
        self.events, self.text, self.first, self.over = [], "", threading.Event(), \
            threading.Event()

    def __call__(self, kind, payload):
        self.events.append((kind, payload))
        if kind == "delta":
            self.text += payload
            self.first.set()
        if kind in ("done", "error"):
            self.over.set()

    @property
    def last(self):
        return self.events[-1][0]


def job(engine, **kw):
    listener = Listener()
    settings = dict(ids=engine.encode(HI), max_tokens=32, temperature=1.0, seed=3)
    return Job(emit=listener, **{**settings, **kw}), listener


def run_alone(scheduler, engine, **kw) -> str:
    j, listener = job(engine, **kw)
    scheduler.submit([j])
    assert listener.over.wait(60) and listener.last == "done"
    return listener.text


@pytest.fixture(scope="module")
def alone(scheduler, engine) -> str:
    text = run_alone(scheduler, engine)
    assert len(set(text)) > 5  # varied text: a damaged answer would show
    return text


@pytest.mark.parametrize("bad", [
    {"seed": 2 ** 64},  # torch's generator cannot take it: the job's setup fails
    {"temperature": float("nan")},  # softmax of NaN: its sampling fails
    {"ids": [10 ** 9]},  # past the embedding: the prefill fails (each job then goes alone)
])
def test_a_failing_job_fails_alone(scheduler, engine, alone, bad):
    # Joining a running batch.
    healthy, h = job(engine)
    scheduler.submit([healthy])
    assert h.first.wait(60)
    broken, b = job(engine, **bad)
    scheduler.submit([broken])
    assert b.over.wait(60) and h.over.wait(60)
    assert b.last == "error" and "internal error" in b.events[-1][1]
    assert h.last == "done" and h.text == alone
    # Prefilled in one batch with it.
    healthy, h = job(engine)
    broken, b = job(engine, **bad)
    scheduler.submit([broken, healthy])
    assert b.over.wait(60) and h.over.wait(60)
    assert b.last == "error" and h.last == "done" and h.text == alone
    assert [k for k, _ in b.events].count("error") == 1  # answered once
    assert run_alone(scheduler, engine) == alone  # the worker goes on
