"""Encode conversations with a template, apply max_length, and cache the result on disk.

The cache key covers everything that changes the tokens: the conversations themselves, the
tokenizer files, the template (its source and system prompt), what is trained (--loss_scale),
max_length and the truncation strategy, so a changed template never reuses stale data.

A conversation the template rejects (its own raise_exception, a role or tool call it cannot
render) is a bad row like any other: named with its file:line, before any weights load.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
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
    """A datasets.Dataset with input_ids/labels/length, and an EncodeReport."""
    import datasets

    if truncation_strategy not in TRUNCATION_STRATEGIES:
        raise UsageError(f"--truncation_strategy {truncation_strategy}: use one of "
                         f"{', '.join(TRUNCATION_STRATEGIES)}.")
    key = cache_key(conversations, template, max_length, truncation_strategy)
    path = os.path.join(cache_dir("datasets"), f"{name}-{key}")
    report_path = os.path.join(path, "swiftlite_report.json")
    if use_cache and os.path.exists(report_path):
        try:
            ds = datasets.load_from_disk(path)
            with open(report_path) as f:
                r = json.load(f)
        except Exception as e:  # a damaged cache is rebuilt, never trusted
            warn(f"{name}: ignoring the unreadable cache {path} ({type(e).__name__}); re-encoding")
        else:
            report = EncodeReport(samples=r["samples"], truncated=r["truncated"],
                                  dropped=Counter(r["dropped"]), lengths=list(ds["length"]),
                                  trained_tokens=r["trained_tokens"], cache_path=path,
                                  from_cache=True)
            info(f"{name}: tokenised data loaded from the cache {path}")
            return ds, report

    from tqdm.auto import tqdm
    report = EncodeReport(samples=len(conversations), cache_path=path)
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
    ds = datasets.Dataset.from_dict(columns)
    if use_cache and len(ds):  # an empty result is an error for the caller, not worth caching
        tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=os.path.dirname(path))
        try:
            # Our own bar above already showed the work; datasets' "Saving the dataset" bar
            # for writing the cache says nothing more.
            with quiet_progress_bars():
                ds.save_to_disk(tmp)
            with open(os.path.join(tmp, "swiftlite_report.json"), "w") as f:
                json.dump(report.to_dict(), f)
            shutil.rmtree(path, ignore_errors=True)
            os.rename(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        ds = datasets.load_from_disk(path)  # memory-mapped: no second copy in RAM
        info(f"{name}: tokenised {len(ds)} samples, cached in {path}")
    return ds, report


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
