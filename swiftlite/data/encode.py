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
from typing import Callable

from swiftlite.errors import UsageError
from swiftlite.log import info, warn
from swiftlite.runtime.paths import cache_dir
from swiftlite.config.constants import IGNORE_INDEX
from swiftlite.data.rows import content
from swiftlite.data.template_base import ChatTemplate

TRUNCATION_STRATEGIES = ("delete", "left", "right")
ENCODER_VERSION = "3"  # bump when encoding or the cache's layout changes (old ones not reused)
ARROW_FILE = "data.arrow"  # a cache entry: this file and swiftlite_report.json
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


def check_truncation_strategy(strategy: str) -> None:
    if strategy not in TRUNCATION_STRATEGIES:
        raise UsageError(f"--truncation_strategy {strategy}: use one of "
                         f"{', '.join(TRUNCATION_STRATEGIES)}.")


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


@dataclass(frozen=True)
class Encoder:
    """What a dataset's samples are: their columns (name -> "ids" for a list of int32 token
    ids, "int" for one int32), and the function that encodes a chunk of conversations:
    chunk(conversations, template, max_length, strategy, name) -> (columns or None, Counts).
    A "length" column (tokens of the sample) is always among them."""
    name: str
    columns: dict
    chunk: Callable


REJECTED = "rejected by the chat template"  # the reason rows are counted under


def cache_key(conversations: list, template: ChatTemplate, max_length: int, strategy: str,
              encoder_name: str = "sft") -> str:
    h = hashlib.sha256()
    h.update(json.dumps([ENCODER_VERSION, template.fingerprint(), template.loss_scale,
                         max_length, strategy] + ([encoder_name] if encoder_name != "sft"
                                                  else [])).encode())
    h.update(tokenizer_fingerprint(template.tokenizer).encode())
    if hasattr(conversations, "digest"):  # data.rows.Rows: the lines as they are on disk
        conversations.digest(h)
        return h.hexdigest()[:24]
    for c in conversations:
        c = content(c) if isinstance(c, dict) else c
        h.update(json.dumps(c, ensure_ascii=False).encode())
    return h.hexdigest()[:24]


def encode_dataset(conversations: list, template: ChatTemplate, *, max_length: int,
                   truncation_strategy: str = "delete", name: str = "train",
                   use_cache: bool = True, skip_bad_rows: bool = False, num_proc: int = 1,
                   encoder: Encoder | None = None):
    """A datasets.Dataset with input_ids/labels/length (or the columns of another encoder,
    such as data.pair_encode's), and an EncodeReport.

    Samples are encoded in chunks (in `num_proc` worker processes when more than 1) and each
    chunk goes straight into an Arrow file, which the dataset then memory-maps: the token ids
    are never all held as Python lists. With the cache, one process encodes and the others
    wait for it (a lock per cache entry): the ranks of a run on one node, or two runs on the
    same data, never encode the same rows twice nor race to write the same folder; they all
    memory-map the one result."""
    check_truncation_strategy(truncation_strategy)
    encoder = encoder or SFT_ENCODER
    job = (conversations, template, max_length, truncation_strategy, name, encoder)
    if not use_cache:
        return _encode_uncached(job, skip_bad_rows, num_proc)
    key = cache_key(conversations, template, max_length, truncation_strategy, encoder.name)
    path = os.path.join(cache_dir("datasets"), f"{name}-{key}")
    with _entry_lock(path):
        if not skip_bad_rows and _left_out_rejected(path):
            # A --skip_bad_rows run's entry: encoding again names those rows and stops; the
            # entry stays for such runs.
            return _encode_uncached(job, skip_bad_rows, num_proc)
        cached = load_cached(path, name)
        if cached is not None:
            return cached
        _sweep(path)
        tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")
        try:
            report = _encode(job, tmp, skip_bad_rows, num_proc)
            report.cache_path = path
            if not report.lengths:  # nothing left: an error for the caller, not worth caching
                return _open(tmp), report
            with open(os.path.join(tmp, "swiftlite_report.json"), "w") as f:
                json.dump(report.to_dict(), f)  # last: a folder with its report is complete
            os.rename(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        info(f"{name}: tokenised {len(report.lengths)} samples, cached in {path}")
        return _open(path), report


def _open(folder: str):
    import datasets
    return datasets.Dataset.from_file(os.path.join(folder, ARROW_FILE))


@contextlib.contextmanager
def _entry_lock(path: str):
    """An exclusive lock on one cache entry, held while it is checked and written. The lock
    files stay (removing one while another process waits on it would let a third in)."""
    import fcntl
    with open(f"{os.path.dirname(path)}/.{os.path.basename(path)}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _encode_uncached(job, skip_bad_rows: bool, num_proc: int):
    tmp = os.path.join(cache_dir("datasets"), f".{job[4]}-uncached.tmp-{os.getpid()}")
    try:
        report = _encode(job, tmp, skip_bad_rows, num_proc)
        return _open(tmp), report  # memory-mapped: the folder can go (Linux keeps the map)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _left_out_rejected(path: str) -> bool:
    """Whether a complete cache entry left out rows the template rejects."""
    try:
        with open(os.path.join(path, "swiftlite_report.json")) as f:
            return bool(json.load(f)["dropped"].get(REJECTED))
    except (OSError, ValueError, KeyError, AttributeError):
        return False


def load_cached(path: str, name: str, skip_bad_rows: bool = True):
    """(dataset, EncodeReport) of a complete cache entry, or None. Without skip_bad_rows, an
    entry that left out rows the template rejects is None too: encoding again names them."""
    report_path = os.path.join(path, "swiftlite_report.json")
    if not os.path.exists(report_path):  # absent, or cut short before its report
        return None
    if not skip_bad_rows and _left_out_rejected(path):
        return None
    try:
        ds = _open(path)
        with open(report_path) as f:
            r = json.load(f)
    except Exception as e:  # a damaged cache is rebuilt, never trusted
        warn(f"{name}: ignoring the unreadable cache {path} ({type(e).__name__}); re-encoding")
        return None
    report = EncodeReport(samples=r["samples"], truncated=r["truncated"],
                          dropped=Counter(r["dropped"]), lengths=_lengths(ds),
                          trained_tokens=r["trained_tokens"], cache_path=path, from_cache=True)
    info(f"{name}: tokenised data loaded from the cache {path}")
    return ds, report


def _lengths(ds) -> list[int]:
    """The length column as Python ints, read as one Arrow column (iterating the dataset's
    column formats each row: 6 s for a million)."""
    return ds.data.column("length").to_pylist()


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


def _encode(job: tuple, out_dir: str, skip_bad_rows: bool, num_proc: int) -> EncodeReport:
    """Encode every chunk of job's conversations into out_dir/data.arrow, in order; the
    EncodeReport of it all. Bad rows are raised (or, with skip_bad_rows, counted) after."""
    import multiprocessing

    import datasets
    from datasets.arrow_writer import ArrowWriter
    from tqdm.auto import tqdm
    conversations, _, _, _, name, encoder = job
    report = EncodeReport(samples=len(conversations))
    starts = range(0, len(conversations), _CHUNK)
    bar = tqdm(total=len(conversations), desc=f"Tokenising {name}", unit="rows",
               disable=len(conversations) < 2 * _CHUNK)
    global _JOB
    _JOB, pool = job, None  # forked workers inherit it: the conversations are not copied
    if num_proc > 1 and len(starts) > 1:
        pool = multiprocessing.get_context("fork").Pool(min(num_proc, len(starts)))
    os.makedirs(out_dir, exist_ok=True)
    features = datasets.Features({
        c: datasets.Sequence(datasets.Value("int32")) if kind == "ids" else datasets.Value("int32")
        for c, kind in encoder.columns.items()})
    rejected = []
    try:
        writer = ArrowWriter(features=features, path=os.path.join(out_dir, ARROW_FILE))
        for table, part in (pool.imap(_encode_chunk, starts) if pool else
                            map(_encode_chunk, starts)):
            if table is not None:
                writer.write_table(table)
            report.truncated += part.truncated
            report.dropped.update(part.dropped)
            report.trained_tokens += part.trained_tokens
            report.lengths += part.lengths
            rejected += part.rejected
            bar.update(part.samples)
        writer.finalize()
    finally:
        bar.close()
        _JOB = None
        if pool is not None:
            pool.terminate()
    if rejected and not skip_bad_rows:
        more = f"\n  ... and {len(rejected) - 5} more" if len(rejected) > 5 else ""
        raise UsageError(f"{len(rejected)} row(s) the chat template cannot render:\n  " +
                         "\n  ".join(rejected[:5]) + more + "\nFix them, or pass "
                         "--skip_bad_rows true to leave them out (skipped rows are counted).")
    if rejected:
        warn(f"{name}: left out {len(rejected)} row(s) the chat template cannot render "
             f"(first: {rejected[0]})")
    return report


@dataclass
class Counts:
    """What became of some conversations: truncated, dropped (per reason), trained tokens."""
    samples: int = 0
    truncated: int = 0
    dropped: Counter = field(default_factory=Counter)
    trained_tokens: int = 0
    lengths: list[int] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)


_JOB = None  # (conversations, template, max_length, truncation_strategy, name, encoder)


def _encode_chunk(start: int):
    """(Arrow table or None, Counts) for the chunk of _JOB's conversations at `start`."""
    import pyarrow as pa
    conversations, template, max_length, strategy, name, encoder = _JOB
    columns, part = encoder.chunk(conversations[start:start + _CHUNK], template, max_length,
                                  strategy, name)
    if columns is None:
        return None, part
    return pa.table({c: pa.array(columns[c], pa.list_(pa.int32()) if kind == "ids"
                                 else pa.int32()) for c, kind in encoder.columns.items()}), part


def count_rejected(part: "Counts", conv, name: str, template: ChatTemplate, e: Exception) -> None:
    """Count a conversation the template cannot render, and say where it came from."""
    where = conv.get("where", f"{name} sample") if isinstance(conv, dict) else name
    part.rejected.append(f"{where}: {template.describe()} cannot render it: {e}")
    part.dropped[REJECTED] += 1


def _sft_chunk(chunk: list, template: ChatTemplate, max_length: int, strategy: str, name: str):
    part, ids, labels = Counts(samples=len(chunk)), [], []
    for conv, sample in zip(chunk, template.encode_batch(chunk)):
        if isinstance(sample, Exception):
            count_rejected(part, conv, name, template, sample)
            continue
        sample = fit(sample, max_length, strategy, part)
        if sample is None:
            continue
        ids.append(sample["input_ids"])
        labels.append(sample["labels"])
        part.lengths.append(len(sample["input_ids"]))
    if not ids:
        return None, part
    return {"input_ids": ids, "labels": labels, "length": part.lengths}, part


SFT_ENCODER = Encoder("sft", {"input_ids": "ids", "labels": "ids", "length": "int"}, _sft_chunk)


def fit(sample: dict, max_length: int, strategy: str, counts: "Counts") -> dict | None:
    """The sample within max_length (truncated by strategy), or None when it is dropped;
    counted in counts either way."""
    if len(sample["input_ids"]) > max_length:
        sample = _truncate(sample, max_length, strategy)
        if sample is None:
            counts.dropped[f"longer than max_length {max_length}"] += 1
            return None
        counts.truncated += 1
    trained = len(sample["labels"]) - sample["labels"].count(IGNORE_INDEX)
    if trained == 0:
        counts.dropped["no trained tokens (reply cut off or empty)"] += 1
        return None
    counts.trained_tokens += trained
    return sample


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


# args.json's dataset_report: how many samples do not end with a trained end-of-turn token
UNTRAINED_END_OF_TURN = "end_of_turn_untrained"


def warn_if_end_of_turn_untrained(ds, template: ChatTemplate, max_length: int | None = None,
                                  column: str = "labels", what: str = "samples") -> int:
    """The end-of-turn token must be trained, or the model never learns to stop: every
    sample's last trained token should be it (column: the labels to look at, e.g. a pair's
    chosen_labels). Returns how many samples' is not, said with how many of those reach
    --max_length (their last reply cut by truncation)."""
    eot = template.tokenizer(template.end_of_turn, add_special_tokens=False)["input_ids"] \
        if template.end_of_turn else []
    if not eot or len(ds) == 0:
        return 0
    import numpy as np
    missing = cut = 0
    rows = ds.select_columns([column]).iter(batch_size=1024) if hasattr(ds, "iter") else [
        {column: [r[column] for r in ds]}]
    for batch in rows:
        for labels in batch[column]:
            labels = np.asarray(labels)
            trained = labels[labels != IGNORE_INDEX]
            if len(trained) and trained[-1] == eot[-1]:
                continue
            missing += 1
            cut += max_length is not None and len(labels) >= max_length
    if missing:
        why = (f"; {cut} of them reach --max_length {max_length}: truncation cut the end of "
               "their last reply (raise --max_length, or --truncation_strategy delete drops "
               "them)" if cut else "")
        warn(f"{missing} of {len(ds)} {what} do not end with a trained end-of-turn token "
             f"{template.end_of_turn!r}{why}. A model that never learns it may not stop.")
    return missing
