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

from array import array
import codecs
import csv
import io
import importlib.resources
import json
import os
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from swiftlite.errors import UsageError
from swiftlite.log import info, warn
from swiftlite.data.formats import BadRow, detect_format, to_conversation
from swiftlite.data.pairs import (EXPECTED as PREFERENCE_EXPECTED, KEYS as PREFERENCE_KEYS,
                                  KTO_FORMATS, PAIR_FORMATS, detect_preference_format,
                                  to_preference)

BUILTIN = {"self-cognition": "self_cognition.jsonl"}
MAX_ERRORS_SHOWN = 5
CSV_CELL_LIMIT = 64 * 2 ** 20  # characters
BYTES_PER_TEXT_CHAR = 16  # see _check_fits
READ_BLOCK = 16 * 2 ** 20  # bytes read at a time when a whole file is scanned
_KEYS = {"messages": {"messages"}, "sharegpt": {"conversations"},
         "alpaca": {"instruction", "output"}, "query-response": {"query", "response"},
         **PREFERENCE_KEYS}
TASKS = ("sft", "preference")  # what the rows are for: conversations, or rlhf's pairs


def content(conv: dict) -> dict:
    """What a conversation or pair says, without where it came from (for cache keys)."""
    return {"messages": conv["messages"], "tools": conv.get("tools"),
            **{k: conv[k] for k in ("chosen", "rejected", "completion", "label") if k in conv}}


def convert(row, fmt: str, require_reply: bool = True) -> dict:
    """The canonical form of one row of a file in format fmt (a conversation, or a pair)."""
    if fmt in PAIR_FORMATS or fmt in KTO_FORMATS:
        return to_preference(row, fmt)
    return to_conversation(row, fmt, require_reply=require_reply)


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


def parse_spec(spec: str) -> tuple[str, int | None]:
    """'data.jsonl#500' -> ('data.jsonl', 500)."""
    path, sep, n = spec.rpartition("#")
    if not sep:
        return spec, None
    if not n.isdigit() or int(n) <= 0:
        raise UsageError(f"--dataset {spec}: after '#' comes a positive number of rows to "
                         f"sample, e.g. {path}#500.")
    return path, int(n)


def read_rows(path: str) -> list[tuple[str, object]]:
    """[(where, row)] for a file; `where` is 'file:line' (jsonl) or 'file row N'."""
    if not os.path.exists(path):
        raise UsageError(f"--dataset {path}: no such file, and not a built-in dataset "
                         f"({', '.join(BUILTIN)}).")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".jsonl":
        return [(where, row) for where, row, _ in jsonl_rows(path)]
    if ext == ".json":
        try:
            data = json.loads(_read_text(path))
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{e.lineno}: invalid JSON ({e.msg}). A .json dataset is one "
                             "JSON list of rows; use .jsonl for one row per line.") from None
        except RecursionError:
            raise UsageError(f"{path}: invalid JSON (nested too deeply to read).") from None
        if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
            data = next(iter(data.values()))  # {"train": [...]}
        if not isinstance(data, list):
            raise UsageError(f"{path}: a .json dataset must be a list of rows.")
        return [(f"{path} row {i}", r) for i, r in enumerate(data, 1)]
    if ext == ".csv":
        # Long replies are legitimate: allow cells far beyond the csv module's 128 KiB default.
        csv.field_size_limit(max(csv.field_size_limit(), CSV_CELL_LIMIT))
        reader = csv.DictReader(io.StringIO(_read_text(path), newline=""))
        rows = []
        try:  # line numbers count the header as line 1
            for i, r in enumerate(reader, 2):
                rows.append((f"{path}:{i}", dict(r)))
        except csv.Error as e:
            raise UsageError(f"{path}:{reader.line_num}: unreadable CSV ({e}).") from None
        return rows
    if ext == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as e:
            raise UsageError(f"--dataset {path}: not a readable parquet file ({e}). Check the "
                             "file is complete, or export the data again.") from None
        return [(f"{path} row {i}", r) for i, r in enumerate(table.to_pylist(), 1)]
    raise UsageError(f"--dataset {path}: unsupported file type {ext or '(none)'}; use .jsonl, "
                     ".json, .csv or .parquet.")


def jsonl_rows(path: str, start: int = 0, end: int | None = None, line: int = 1):
    """(where, row or BadRow, byte offset of the line) for each non-blank line, one at a
    time (a file of any size is never held in memory). With start/end: the lines that begin
    in [start, end), where start is the beginning of line number `line`."""
    with open(path, "rb") as f:
        f.seek(start)
        offset = start
        for i, raw in enumerate(f, line):
            if end is not None and offset >= end:
                return
            begin, offset = offset, offset + len(raw)
            if i == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)  # written by some Windows editors
            if not raw.strip():
                continue
            yield f"{path}:{i}", _parse_line(raw), begin


def _parts(path: str, n: int) -> list[tuple[int, int, int]]:
    """n parts of a file as (start, end, first line number), split at line beginnings."""
    size = os.path.getsize(path)
    if n == 1:
        return [(0, size, 1)]
    cuts, line = [], 1
    with open(path, "rb") as f:
        start = 0
        for k in range(1, n + 1):
            end = size
            if k < n:
                f.seek(max(start, size * k // n))
                f.readline()  # to the beginning of the next line
                end = min(f.tell(), size)
            cuts.append((start, end, line))
            f.seek(start)
            line += _count_newlines(f, end - start)
            start = end
    return [c for c in cuts if c[1] > c[0]] or [(0, size, 1)]


def _count_newlines(f, n: int) -> int:
    return sum(block.count(b"\n") for block in _blocks(f, n))


def _blocks(f, n: int | None = None):
    """The next n bytes of the open file f (all that is left when None), in blocks."""
    while n is None or n > 0:
        block = f.read(READ_BLOCK if n is None else min(n, READ_BLOCK))
        if not block:
            return
        yield block
        n = None if n is None else n - len(block)


def _parse_line(raw: bytes):
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return BadRow(f"not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the "
                      "line); save the file as UTF-8", "not UTF-8")
    except json.JSONDecodeError as e:
        return BadRow(f"invalid JSON ({e.msg} at column {e.colno})", "invalid JSON")
    except RecursionError:
        return BadRow("invalid JSON (nested too deeply to read)", "invalid JSON")


class Rows(Sequence):
    """Validated conversations. Rows of .jsonl files are kept as (file, byte offset, line)
    and read back, parsed and normalised again when asked for (each process opens its own
    file handles), so a file of millions of rows costs a few bytes a row here, not its
    parsed dicts; rows of other formats are held as conversations."""

    def __init__(self, items: list, files: list[tuple[str, str, bool]]):
        self._items, self._files, self._handles = items, files, {}

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._get(x) for x in self._items[i]]
        return self._get(self._items[i])

    def __eq__(self, other) -> bool:
        return isinstance(other, (list, Rows)) and list(self) == list(other)

    def _get(self, item) -> dict:
        if isinstance(item, dict):
            return item
        index, offset, line = item
        path, fmt, require_reply = self._files[index]
        raw = self._line(index, offset)
        conv = convert(json.loads(raw.removeprefix(codecs.BOM_UTF8).decode("utf-8")), fmt,
                       require_reply)
        conv["where"] = f"{path}:{line}"
        return conv

    def digest(self, h) -> None:
        """Feed the content of the conversations, in order, to the hash h: for .jsonl rows,
        the bytes of each file they come from and their places in it (no parsing, and no
        seeking back to each line), others as JSON."""
        places = array("q")
        for index in sorted({item[0] for item in self._items if not isinstance(item, dict)}):
            path, fmt, _ = self._files[index]
            h.update(f"{index}:{fmt}:".encode())
            with open(path, "rb") as f:
                for block in _blocks(f):
                    h.update(block)
        for item in self._items:
            if isinstance(item, dict):
                h.update(places.tobytes())
                places = array("q")
                h.update(json.dumps(content(item), ensure_ascii=False).encode())
            else:
                places.extend(item[:2])
        h.update(places.tobytes())

    def _line(self, index: int, offset: int) -> bytes:
        """The raw line at `offset` of file `index`."""
        key = (os.getpid(), index)  # a forked worker must not share its parent's file offset
        if key not in self._handles:
            self._handles[key] = open(self._files[index][0], "rb")
        f = self._handles[key]
        f.seek(offset)
        return f.readline()

    def __getstate__(self):
        return {"_items": self._items, "_files": self._files, "_handles": {}}


def _read_text(path: str) -> str:
    """A whole file as UTF-8 text (a BOM is dropped); UsageError naming the line otherwise."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise UsageError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x}); save the "
                         "file as UTF-8.") from None


def _builtin_rows(name: str, model_name: list[str], model_author: list[str]):
    res = importlib.resources.files("swiftlite.data") / BUILTIN[name]
    # {{NAME}}/{{AUTHOR}} take the first value in English rows and the second (if given) in
    # Chinese rows, like ms-swift's --model_name 小黄 'Xiao Huang'.
    name_en, name_zh = _pair(model_name, "swiftlite-assistant")
    author_en, author_zh = _pair(model_author, "the swiftlite team")
    rows = []
    for i, line in enumerate(res.read_text(encoding="utf-8").splitlines(), 1):
        row = json.loads(line)
        zh = row.pop("tag", "en") == "zh"
        for k in ("query", "response"):
            row[k] = (row[k].replace("{{NAME}}", name_zh if zh else name_en)
                      .replace("{{AUTHOR}}", author_zh if zh else author_en))
        rows.append((f"{name}:{i}", row))
    return rows


def _pair(values, default: str) -> tuple[str, str]:
    if not values:
        return default, default
    if isinstance(values, str):
        values = [values]
    return values[0], values[1] if len(values) > 1 else values[0]


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
        fmt = file_format(raw_rows, skip_bad_rows, task)
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
    jobs = [(path, fmt, require_reply, index, part) for part in _parts(path, n)]
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


def open_rows(path: str, model_name=None, model_author=None):
    """(raw_rows, lazy): raw_rows() yields (where, row or BadRow, byte offset or None) for
    each row of a file or built-in, every time it is called; lazy when the file is a .jsonl,
    streamed from disk rather than held in memory."""
    builtin = path in BUILTIN and not os.path.exists(path)
    if not builtin and path.lower().endswith(".jsonl") and os.path.exists(path):
        return (lambda: jsonl_rows(path)), True
    held = _builtin_rows(path, model_name, model_author) if builtin else read_rows(path)
    return (lambda: ((where, row, None) for where, row in held)), False


def file_format(raw_rows, skip_bad_rows: bool, task: str = "sft") -> str | None:
    """The dataset format of a file, from its first rows that have one (None when no row
    has one and skip_bad_rows lets every row be skipped)."""
    detect = detect_preference_format if task == "preference" else detect_format
    first_where, first = None, None
    for where, row, _ in raw_rows():
        first_where = first_where or where
        if isinstance(row, BadRow):
            continue
        first = row if first is None else first
        fmt = detect(row)
        if fmt:
            return fmt
    if first is not None and not skip_bad_rows:
        keys = sorted(first) if isinstance(first, dict) else type(first).__name__
        expected = PREFERENCE_EXPECTED if task == "preference" else (
            "'messages' (OpenAI), 'conversations' (ShareGPT), 'instruction' + 'output' "
            "(Alpaca) or 'query' + 'response'")
        hint = ""
        if task == "sft" and detect_preference_format(first):
            hint = " These are preference rows: train on them with swiftlite rlhf."
        elif task == "preference" and detect_format(first):
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
    own = detect_preference_format(row) if preference else detect_format(row)
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
