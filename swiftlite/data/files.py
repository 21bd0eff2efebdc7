"""Dataset files and built-ins as rows: a spec (file or built-in, optionally NAME#N), and each
row with where it came from (file:line), read from .jsonl (streamed, in parts for parallel
checking), .json, .csv and .parquet files. A row that cannot be read is a BadRow, not an error:
data.loader decides what bad rows do."""
from __future__ import annotations

import codecs
import csv
import importlib.resources
import io
import json
import os

from swiftlite.data.formats import BadRow
from swiftlite.errors import UsageError

BUILTIN = {"self-cognition": "self_cognition.jsonl"}


CSV_CELL_LIMIT = 64 * 2 ** 20  # characters


READ_BLOCK = 16 * 2 ** 20  # bytes read at a time when a whole file is scanned


def parse_spec(spec: str) -> tuple[str, int | None]:
    """'data.jsonl#500' -> ('data.jsonl', 500). Only a trailing '#' and digits is a count: a
    '#' elsewhere ('exp#2/data.jsonl') belongs to the path."""
    path, sep, n = spec.rpartition("#")
    if not sep or not n.isdigit() or os.path.exists(spec):
        return spec, None
    if int(n) <= 0:
        raise UsageError(f"--dataset {spec}: after '#' comes a positive number of rows to "
                         f"sample, e.g. {path}#500.")
    return path, int(n)


def no_such_file(path: str) -> str:
    """What to say of a dataset path that is neither a file nor a built-in."""
    hint = (" After '#' comes a positive number of rows to sample, e.g. "
            f"{path.rpartition('#')[0]}#500." if "#" in path else "")
    return (f"--dataset {path}: no such file, and not a built-in dataset "
            f"({', '.join(BUILTIN)}).{hint}")


def read_rows(path: str) -> list[tuple[str, object]]:
    """[(where, row)] for a file; `where` is 'file:line' (jsonl) or 'file row N'."""
    if not os.path.exists(path):
        raise UsageError(no_such_file(path))
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
        return _csv_rows(path)
    if ext == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as e:
            raise UsageError(f"--dataset {path}: not a readable parquet file ({e}). Check the "
                             "file is complete, or export the data again.") from None
        return [(f"{path} row {i}", _without_nulls(r))
                for i, r in enumerate(table.to_pylist(), 1)]
    raise UsageError(f"--dataset {path}: unsupported file type {ext or '(none)'}; use .jsonl, "
                     ".json, .csv or .parquet.")


def _csv_rows(path: str) -> list[tuple[str, object]]:
    """[(file:line, row or BadRow)]: each record named by the line it starts on (a quoted cell
    may span lines; blank lines are skipped), and a record with more cells than the header is
    a BadRow: an unquoted comma in a reply would otherwise cut the reply short unnoticed."""
    # Long replies are legitimate: allow cells far beyond the csv module's 128 KiB default.
    csv.field_size_limit(max(csv.field_size_limit(), CSV_CELL_LIMIT))
    reader = csv.reader(io.StringIO(_read_text(path), newline=""))
    rows, header = [], None
    try:
        while True:
            line = reader.line_num + 1
            cells = next(reader, None)
            if cells is None:
                return rows
            if not cells:
                continue
            if header is None:
                header = cells
            elif len(cells) > len(header):
                rows.append((f"{path}:{line}", BadRow(
                    f"{len(cells)} cells, the header has {len(header)}: quote cells that contain "
                    'commas ("It is 4, of course.")', "extra CSV cells")))
            else:  # missing trailing cells are None, as csv.DictReader gives them
                rows.append((f"{path}:{line}", dict(zip(header, cells + [None] * len(header)))))
    except csv.Error as e:
        raise UsageError(f"{path}:{reader.line_num}: unreadable CSV ({e}).") from None


def _without_nulls(value):
    """A parquet row without the null entries of its structs: parquet stores a column's rows
    as one struct type, the union of all their keys, so a row reads back with every other
    row's keys as None (a tool call's arguments {"city": "Paris", "tz": None}). None means
    absent everywhere swiftlite reads a row."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


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


def file_parts(path: str, n: int) -> list[tuple[int, int, int]]:
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
    return sum(block.count(b"\n") for block in blocks(f, n))


def blocks(f, n: int | None = None):
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


def open_rows(path: str, model_name=None, model_author=None):
    """(raw_rows, lazy): raw_rows() yields (where, row or BadRow, byte offset or None) for
    each row of a file or built-in, every time it is called; lazy when the file is a .jsonl,
    streamed from disk rather than held in memory."""
    builtin = path in BUILTIN and not os.path.exists(path)
    if not builtin and path.lower().endswith(".jsonl") and os.path.exists(path):
        return (lambda: jsonl_rows(path)), True
    held = _builtin_rows(path, model_name, model_author) if builtin else read_rows(path)
    return (lambda: ((where, row, None) for where, row in held)), False
