"""Read `--dataset` specs into validated conversations.

A spec is a local file (.jsonl, .json, .csv, .parquet) or a built-in name, optionally with
`#N` to sample N rows (seeded; N larger than the data repeats it). Every row is checked before
any model is loaded: a bad row stops the run with its file, line and reason, unless
skip_bad_rows is set, in which case bad rows are counted per reason and reported.

Each conversation is {"messages", "tools"?, "where"}; "where" (file:line) names it in errors.
A validation split is taken from the distinct rows of each file before #N sampling repeats
rows, so no validation row is a copy of a training row.
"""
from __future__ import annotations

import json
import os
import random
from collections import Counter
from dataclasses import dataclass, field

from swiftlite.data.files import file_parts, jsonl_rows, open_rows, parse_spec
from swiftlite.data.formats import BadRow, detect_format
from swiftlite.data.pairs import (EXPECTED as PREFERENCE_EXPECTED, KEYS as PREFERENCE_KEYS,
                                  KTO_FORMATS, PAIR_FORMATS, detect_preference_format)
from swiftlite.data.rows import Rows, convert
from swiftlite.errors import UsageError
from swiftlite.log import info, warn

MAX_ERRORS_SHOWN = 5
BYTES_PER_TEXT_CHAR = 16  # see _check_fits
_KEYS = {"messages": {"messages"}, "sharegpt": {"conversations"},
         "alpaca": {"instruction", "output"}, "query-response": {"query", "response"},
         **PREFERENCE_KEYS}
TASKS = ("sft", "preference")  # what the rows are for: conversations, or rlhf's pairs


@dataclass
class LoadReport:
    rows: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    validation: int = 0  # samples split off for validation (--split_dataset_ratio)

    def to_dict(self) -> dict:
        return {"rows": self.rows, "kept": self.kept, "skipped": dict(self.skipped),
                "validation": self.validation}

    @classmethod
    def from_dict(cls, d: dict) -> "LoadReport":
        return cls(d["rows"], d["kept"], Counter(d["skipped"]), d["validation"])

    def summary(self) -> str:
        """e.g. "6 rows read -> 9 samples (#N sampling)", "10 rows read, 2 skipped (...) -> 8
        samples": #N can repeat or leave out rows, so samples are not "kept rows"."""
        bad = sum(self.skipped.values())
        s = f"{self.rows} rows read"
        if bad:
            s += f", {bad} skipped (" + ", ".join(
                f"{n} {k}" for k, n in self.skipped.most_common()) + ")"
        s += f" -> {self.kept} samples"
        if self.validation:
            s += f" + {self.validation} for validation"
        if self.kept + self.validation != self.rows - bad:
            s += " (#N sampling)"
        return s


def _check_fits(spec: str, rows: list, n: int) -> None:
    """Refuse #N sampling that cannot fit in memory, before building it. Each sample is held
    as Python token lists while it is encoded: at least BYTES_PER_TEXT_CHAR per character of
    its conversation (a lower bound), against the memory available now."""
    import psutil
    probe = rows[:: max(1, len(rows) // 200)]  # a Rows slice: read back as conversations
    chars = sum(len(json.dumps(r["messages"], ensure_ascii=False)) for r in probe) / len(probe)
    need, free = n * chars * BYTES_PER_TEXT_CHAR, psutil.virtual_memory().available
    if need > free:
        raise UsageError(f"--dataset {spec}: {n:,} samples of about {chars:.0f} characters need "
                         f"at least {need / 2 ** 30:,.1f} GiB to encode, and {free / 2 ** 30:,.1f} "
                         f"GiB is available. Sample fewer rows (at most about "
                         f"{int(free / (chars * BYTES_PER_TEXT_CHAR)):,}), or train more epochs "
                         "(--num_train_epochs) instead of repeating rows.")


def _sample(rows: list, n: int, seed: int) -> list:
    rng = random.Random(seed)
    out = []
    while len(out) + len(rows) <= n:  # whole copies first, then a seeded subset
        out += rows
    return out + rng.sample(rows, n - len(out))


@dataclass
class Loaded:
    train: Rows
    val: Rows
    report: LoadReport


def load_conversations(specs: list[str], **kwargs) -> tuple[list[dict], LoadReport]:
    """Validated conversations from all specs, in order, as a list (load_datasets keeps
    .jsonl rows on disk until they are needed); raises UsageError on bad rows."""
    loaded = load_datasets(specs, **kwargs)
    return list(loaded.train), loaded.report


def load_datasets(specs: list[str], *, seed: int = 42, skip_bad_rows: bool = False,
                  model_name=None, model_author=None, require_reply: bool = True,
                  split_ratio: float = 0.0, num_proc: int = 1, task: str = "sft") -> Loaded:
    """load_conversations, plus a validation split of split_ratio of each spec's distinct rows
    (taken before #N sampling). A large .jsonl file is checked by num_proc processes, each
    reading its own part of the file."""
    report, convs, val, errors, files = LoadReport(), [], [], [], []
    for spec in specs:
        path, n = parse_spec(spec)
        raw_rows, lazy = open_rows(path, model_name, model_author)
        fmt = file_format(raw_rows, skip_bad_rows, task, require_reply)
        files.append((path, fmt, require_reply))
        if lazy:
            good = _check_jsonl(path, fmt, require_reply, len(files) - 1, num_proc, report,
                                errors)
        else:
            good = []
            for where, row, _ in raw_rows():
                conv = _checked(row, where, fmt, require_reply, report, errors)
                if conv is not None:
                    good.append(conv)
        if not good:
            continue
        if split_ratio > 0:
            held, good = _split(good, split_ratio, n, seed)
            val += held
            n = None if n is None else max(n - len(held), 1)
        if n is not None:
            _check_fits(spec, Rows(good, files), n)
            if n > len(good):
                info(f"{spec}: {len(good)} rows, sampling {n} repeats them.")
            good = _sample(good, n, seed)
        convs += good
    bad = sum(report.skipped.values())
    if errors and not skip_bad_rows:
        more = f"\n  ... and {bad - len(errors)} more" if bad > len(errors) else ""
        raise UsageError(f"{bad} bad row(s) in the dataset:\n  " +
                         "\n  ".join(errors) + more +
                         "\nFix them, or pass --skip_bad_rows true to leave them out "
                         "(skipped rows are counted).")
    if errors:
        warn(f"skipped {bad} bad row(s): " + ", ".join(
            f"{n} {k}" for k, n in report.skipped.most_common()) + f" (first: {errors[0]})")
    report.kept, report.validation = len(convs), len(val)
    if not convs:
        raise UsageError(f"the dataset {' '.join(specs)} has no usable rows ({report.summary()}).")
    return Loaded(Rows(convs, files), Rows(val, files), report)


PARALLEL_CHECK_BYTES = 32 * 2 ** 20  # smaller .jsonl files are checked in one process


def _check_jsonl(path: str, fmt, require_reply: bool, index: int, num_proc: int,
                 report: LoadReport, errors: list) -> list[tuple[int, int, int]]:
    """The (file index, byte offset, line) of each good row of a .jsonl file, checked in
    num_proc processes when the file is large; bad rows counted in report, the first ones
    described in errors, in the order of the file."""
    n = num_proc if num_proc > 1 and os.path.getsize(path) >= PARALLEL_CHECK_BYTES else 1
    jobs = [(path, fmt, require_reply, index, part) for part in file_parts(path, n)]
    if len(jobs) > 1:
        import multiprocessing
        with multiprocessing.get_context("fork").Pool(len(jobs)) as pool:
            results = pool.map(_check_part, jobs)
    else:
        results = [_check_part(jobs[0])]
    good = []
    for part_good, part_report, part_errors in results:
        good += part_good
        report.rows += part_report.rows
        report.skipped.update(part_report.skipped)
        errors += part_errors[:MAX_ERRORS_SHOWN - len(errors)]
    return good


def _check_part(job) -> tuple[list, LoadReport, list]:
    path, fmt, require_reply, index, (start, end, line) = job
    good, report, errors = [], LoadReport(), []
    for where, row, offset in jsonl_rows(path, start, end, line):
        if _checked(row, where, fmt, require_reply, report, errors) is not None:
            good.append((index, offset, int(where.rsplit(":", 1)[1])))
    return good, report, errors


def _checked(row, where: str, fmt, require_reply: bool, report: LoadReport, errors: list):
    """check_row, counting the row in report; None (and the reason counted, the first ones
    kept in errors) for a bad row."""
    report.rows += 1
    try:
        return check_row(row, where, fmt, require_reply)
    except BadRow as e:
        report.skipped[e.kind] += 1
        if len(errors) < MAX_ERRORS_SHOWN:  # the rest are counted, not kept
            errors.append(f"{where}: {e}")
        return None


def file_format(raw_rows, skip_bad_rows: bool, task: str = "sft",
                require_reply: bool = True) -> str | None:
    """The dataset format of a file, from its first rows that have one (None when no row
    has one and skip_bad_rows lets every row be skipped). task: sft, preference (pairs or
    KTO's labelled rows) or pairs (the methods that need a chosen and a rejected reply)."""
    detect = detect_preference_format if task != "sft" else (
        lambda row: detect_format(row, require_reply))
    first_where, first = None, None
    for where, row, _ in raw_rows():
        first_where = first_where or where
        if isinstance(row, BadRow):
            continue
        first = row if first is None else first
        fmt = detect(row)
        if fmt in KTO_FORMATS and task == "pairs":
            raise UsageError(f"{where}: these rows are unpaired (a completion with a label), "
                             "which only --rlhf_type kto trains on; give pairs (chosen and "
                             "rejected) or use --rlhf_type kto.")
        if fmt:
            return fmt
    if first is not None and not skip_bad_rows:
        keys = sorted(first) if isinstance(first, dict) else type(first).__name__
        expected = PREFERENCE_EXPECTED if task != "sft" else (
            "'messages' (OpenAI), 'conversations' (ShareGPT), 'instruction' + 'output' "
            "(Alpaca) or 'query' + 'response'")
        hint = ""
        if task == "sft" and detect_preference_format(first):
            hint = " These are preference rows: train on them with swiftlite rlhf."
        elif task != "sft" and detect_format(first):
            hint = (" These are SFT conversations without a rejected reply: train on them with "
                    "swiftlite sft, or add the rejected replies.")
        raise UsageError(f"{first_where}: unknown {'preference ' if task != 'sft' else ''}"
                         f"dataset format (columns {keys}). Expected {expected}.{hint}")
    return None


def check_row(row, where: str, fmt: str | None, require_reply: bool = True) -> dict:
    """The conversation of one row of a file in format fmt; BadRow says why it has none."""
    if isinstance(row, BadRow):
        raise row
    preference = fmt in PAIR_FORMATS or fmt in KTO_FORMATS
    own = detect_preference_format(row) if preference else detect_format(row, require_reply)
    if fmt is None:
        raise BadRow("unknown format", "unknown format")
    if own is None and isinstance(row, dict) and not set(row) & _KEYS[fmt]:
        raise BadRow(f"unknown format: columns {sorted(row)}, but the file's rows "
                     f"are {fmt} ({' + '.join(sorted(_KEYS[fmt]))})", "unknown format")
    if own is not None and own != fmt:
        raise BadRow(f"row is in the {own} format, the file's first rows are {fmt}",
                     "mixed formats")
    conv = convert(row, fmt, require_reply)
    conv["where"] = where
    return conv

def _split(rows: list, ratio: float, n: int | None, seed: int) -> tuple[list, list]:
    """(validation, training) rows: ratio of the rows that will be used (all of them, or the
    N of #N when that is fewer), at least one each when there are two rows or more."""
    if len(rows) < 2:
        return [], rows
    used = min(n, len(rows)) if n is not None else len(rows)
    k = min(max(1, round(ratio * used)), len(rows) - 1)
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    held = set(order[:k])
    return ([rows[i] for i in sorted(held)],
            [r for i, r in enumerate(rows) if i not in held])
