"""Encode conversations with a template, apply max_length, and cache the result on disk.

The cache key covers everything that changes the tokens: the conversations themselves, the
tokenizer files, the template (its source and system prompt), what is trained (--loss_scale),
max_length and the truncation strategy, so a changed template never reuses stale data.

A conversation the template rejects (its own raise_exception, a role or tool call it cannot
render) is a bad row like any other: named with its file:line, before any weights load.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections import Counter
from dataclasses import dataclass, field

from swiftlite.errors import UsageError
from swiftlite.log import info, quiet_progress_bars, warn
from swiftlite.runtime.paths import cache_dir
from swiftlite.config.constants import IGNORE_INDEX
from swiftlite.data.template_base import ChatTemplate

TRUNCATION_STRATEGIES = ("delete", "left", "right")
ENCODER_VERSION = "2"  # bump when encoding changes, so old caches are not reused
_CHUNK = 1000


@dataclass
class EncodeReport:
    samples: int = 0
    truncated: int = 0
    dropped: Counter = field(default_factory=Counter)
    lengths: list[int] = field(default_factory=list)
    trained_tokens: int = 0
    cache_path: str = ""
    from_cache: bool = False

    def to_dict(self) -> dict:
        lens = sorted(self.lengths)
        return {"samples": self.samples, "truncated": self.truncated,
                "dropped": dict(self.dropped), "trained_tokens": self.trained_tokens,
                "tokens": sum(lens), "min_length": lens[0] if lens else 0,
                "mean_length": round(sum(lens) / len(lens), 1) if lens else 0,
                "max_length": lens[-1] if lens else 0,
                "p95_length": lens[int(0.95 * (len(lens) - 1))] if lens else 0,
                "cache_path": self.cache_path, "from_cache": self.from_cache}


def _truncate(sample: dict, max_length: int, strategy: str) -> dict | None:
    ids, labels = sample["input_ids"], sample["labels"]
    if strategy == "delete":
        return None
    if strategy == "right":
        return {"input_ids": ids[:max_length], "labels": labels[:max_length]}
    return {"input_ids": ids[-max_length:], "labels": labels[-max_length:]}


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the tokenizer's vocabulary and special tokens."""
    h = hashlib.sha256()
    h.update(tokenizer.backend_tokenizer.to_str().encode() if hasattr(
        tokenizer, "backend_tokenizer") else repr(sorted(tokenizer.get_vocab().items())).encode())
    h.update(repr(tokenizer.all_special_tokens).encode())
    return h.hexdigest()[:16]


def cache_key(conversations: list, template: ChatTemplate, max_length: int, strategy: str) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([ENCODER_VERSION, template.fingerprint(), template.loss_scale,
                         max_length, strategy]).encode())
    h.update(tokenizer_fingerprint(template.tokenizer).encode())
    for c in conversations:
        c = {"messages": c["messages"], "tools": c.get("tools")} if isinstance(c, dict) else c
        h.update(json.dumps(c, ensure_ascii=False).encode())
    return h.hexdigest()[:24]


def encode_dataset(conversations: list, template: ChatTemplate, *, max_length: int,
                   truncation_strategy: str = "delete", name: str = "train",
                   use_cache: bool = True, skip_bad_rows: bool = False):
    """A datasets.Dataset with input_ids/labels/length, and an EncodeReport.

    With the cache, one process encodes and the others wait for it (a lock per cache entry):
    the ranks of a run on one node, or two runs on the same data, never encode the same
    rows twice nor race to write the same folder; they all memory-map the one result."""
    if truncation_strategy not in TRUNCATION_STRATEGIES:
        raise UsageError(f"--truncation_strategy {truncation_strategy}: use one of "
                         f"{', '.join(TRUNCATION_STRATEGIES)}.")
    encode = lambda: _encode(conversations, template, max_length, truncation_strategy, name,
                             skip_bad_rows)  # noqa: E731
    if not use_cache:
        return encode()
    key = cache_key(conversations, template, max_length, truncation_strategy)
    path = os.path.join(cache_dir("datasets"), f"{name}-{key}")
    with _entry_lock(path):
        cached = _load_cache(path, name)
        if cached is not None:
            return cached
        _sweep(path)
        ds, report = encode()
        report.cache_path = path
        if len(ds):  # an empty result is an error for the caller, not worth caching
            ds = _write_cache(ds, report, path)
            info(f"{name}: tokenised {len(ds)} samples, cached in {path}")
        return ds, report


@contextlib.contextmanager
def _entry_lock(path: str):
    """An exclusive lock on one cache entry, held while it is checked and written. The lock
    files stay (removing one while another process waits on it would let a third in)."""
    import fcntl
    with open(f"{os.path.dirname(path)}/.{os.path.basename(path)}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _load_cache(path: str, name: str):
    import datasets
    report_path = os.path.join(path, "swiftlite_report.json")
    if not os.path.exists(report_path):  # absent, or cut short before its report
        return None
    try:
        ds = datasets.load_from_disk(path)
        with open(report_path) as f:
            r = json.load(f)
    except Exception as e:  # a damaged cache is rebuilt, never trusted
        warn(f"{name}: ignoring the unreadable cache {path} ({type(e).__name__}); re-encoding")
        return None
    report = EncodeReport(samples=r["samples"], truncated=r["truncated"],
                          dropped=Counter(r["dropped"]), lengths=list(ds["length"]),
                          trained_tokens=r["trained_tokens"], cache_path=path, from_cache=True)
    info(f"{name}: tokenised data loaded from the cache {path}")
    return ds, report


def _sweep(path: str) -> None:
    """Under the entry's lock: what killed writers of this entry left (its temp folders, a
    folder without its report), and temp folders of the old naming a day old or more."""
    import re
    import time
    folder, base = os.path.split(path)
    for n in os.listdir(folder):
        p = os.path.join(folder, n)
        ours = n.startswith(f".{base}.tmp-")
        legacy = re.fullmatch(r"\.(train|val)-[a-z0-9_]{8}", n) is not None
        try:
            if ours or (legacy and time.time() - os.path.getmtime(p) > 86400):
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)  # no report: never finished


def _write_cache(ds, report: EncodeReport, path: str):
    """Written beside the entry and renamed into place complete; returns the memory-mapped
    copy (no second copy in RAM)."""
    import datasets
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        # Our own bar already showed the work; datasets' "Saving the dataset" bar says no more.
        with quiet_progress_bars():
            ds.save_to_disk(tmp)
        with open(os.path.join(tmp, "swiftlite_report.json"), "w") as f:
            json.dump(report.to_dict(), f)
        os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return datasets.load_from_disk(path)


def _encode(conversations: list, template: ChatTemplate, max_length: int, truncation_strategy: str,
            name: str, skip_bad_rows: bool):
    import datasets
    from tqdm.auto import tqdm
    report = EncodeReport(samples=len(conversations))
    columns = {"input_ids": [], "labels": [], "length": []}
    bar = tqdm(total=len(conversations), desc=f"Tokenising {name}", unit="rows",
               disable=len(conversations) < 2 * _CHUNK)
    rejected = []
    for start in range(0, len(conversations), _CHUNK):
        chunk = conversations[start:start + _CHUNK]
        for conv, sample in zip(chunk, template.encode_batch(chunk)):
            if isinstance(sample, Exception):
                where = conv.get("where", f"{name} sample") if isinstance(conv, dict) else name
                rejected.append(f"{where}: {template.describe()} cannot render it: {sample}")
                report.dropped["rejected by the chat template"] += 1
                continue
            if len(sample["input_ids"]) > max_length:
                sample = _truncate(sample, max_length, truncation_strategy)
                if sample is None:
                    report.dropped[f"longer than max_length {max_length}"] += 1
                    continue
                report.truncated += 1
            trained = sum(1 for x in sample["labels"] if x != IGNORE_INDEX)
            if trained == 0:
                report.dropped["no trained tokens (reply cut off or empty)"] += 1
                continue
            report.trained_tokens += trained
            columns["input_ids"].append(sample["input_ids"])
            columns["labels"].append(sample["labels"])
            columns["length"].append(len(sample["input_ids"]))
        bar.update(min(_CHUNK, len(conversations) - start))
    bar.close()
    if rejected and not skip_bad_rows:
        more = f"\n  ... and {len(rejected) - 5} more" if len(rejected) > 5 else ""
        raise UsageError(f"{len(rejected)} row(s) the chat template cannot render:\n  " +
                         "\n  ".join(rejected[:5]) + more + "\nFix them, or pass "
                         "--skip_bad_rows true to leave them out (skipped rows are counted).")
    if rejected:
        warn(f"{name}: left out {len(rejected)} row(s) the chat template cannot render "
             f"(first: {rejected[0]})")
    report.lengths = columns["length"]
    return datasets.Dataset.from_dict(columns), report


def describe(report: EncodeReport, name: str, max_length: int) -> str:
    d = report.to_dict()
    lines = [f"{name}: {len(report.lengths)} samples of {d['samples']}" + (
        f"; tokens per sample min {d['min_length']}, mean {d['mean_length']}, p95 "
        f"{d['p95_length']}, max {d['max_length']} (max_length {max_length}); "
        f"{d['trained_tokens']} trained tokens of {d['tokens']}" if report.lengths else "")]
    lines.append(f"  truncated: {report.truncated}; dropped: " + (", ".join(
        f"{n} {k}" for k, n in report.dropped.items()) if report.dropped else "0"))
    return "\n".join(lines)


def show_sample(sample: dict, tokenizer) -> str:
    """One encoded sample as text: the input, and the labels with masked spans as [-100 x N]."""
    ids, labels = sample["input_ids"], sample["labels"]
    parts, i = [], 0
    while i < len(labels):
        j = i
        masked = labels[i] == IGNORE_INDEX
        while j < len(labels) and (labels[j] == IGNORE_INDEX) == masked:
            j += 1
        parts.append(f"[-100 x {j - i}]" if masked else tokenizer.decode(labels[i:j]))
        i = j
    return (f"input_ids ({len(ids)} tokens):\n{tokenizer.decode(ids)}\n"
            f"labels (trained part):\n{''.join(parts)}")


def warn_if_end_of_turn_untrained(ds, template: ChatTemplate) -> None:
    """The end-of-turn token must be trained, or the model never learns to stop."""
    eot = template.tokenizer(template.end_of_turn, add_special_tokens=False)["input_ids"] \
        if template.end_of_turn else []
    if not eot or len(ds) == 0:
        return
    sample = ds[0]["labels"]
    if eot[-1] not in sample:
        warn(f"the end-of-turn token {template.end_of_turn!r} is never trained in the first "
             "sample: the model may not learn to stop. Check the template.")
