"""A warm start that does not read the data again.

The encoding cache is keyed on the conversations themselves, so finding it means reading and
checking every row first (seconds per 100k rows). A manifest remembers, for one set of
`--dataset`/`--val_dataset` files as they are on disk (path, size, modification time and a
hash of sampled blocks) and the settings that shape what is read from them, which encoded
entries the rows became under each template and max_length, with the reading report. A run
with the same files and settings loads those entries directly; any change to a file (its
size, time or a sampled block) or a setting misses, and the data is read and checked again.
"""
from __future__ import annotations

import hashlib
import json
import os

from swiftlite.runtime.atomic import write_json
from swiftlite.runtime.paths import cache_dir

SAMPLED_BLOCKS, BLOCK = 16, 64 * 1024  # plus the first and last MiB of each file


def files_key(args) -> str | None:
    """The key of the data files as they are now, with the settings that decide which rows
    are read from them; None if a file is missing (the normal path will say so)."""
    from swiftlite.data.encode import ENCODER_VERSION
    from swiftlite.data.files import BUILTIN, parse_spec
    h = hashlib.sha256(json.dumps(
        [ENCODER_VERSION, args.dataset, args.val_dataset, args.data_seed,
         args.split_dataset_ratio, args.skip_bad_rows, args.model_name, args.model_author]
    ).encode())
    for spec in list(args.dataset) + list(args.val_dataset):
        try:
            path, _ = parse_spec(spec)
        except Exception:
            return None
        if path in BUILTIN and not os.path.exists(path):
            import importlib.resources
            h.update((importlib.resources.files("swiftlite.data") / BUILTIN[path]).read_bytes())
            continue
        try:
            h.update(_file_fingerprint(path).encode())
        except OSError:
            return None
    return h.hexdigest()[:24]


def _file_fingerprint(path: str) -> str:
    st = os.stat(path)
    h = hashlib.sha256(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        h.update(f.read(2 ** 20))
        for k in range(SAMPLED_BLOCKS):
            f.seek(st.st_size * k // SAMPLED_BLOCKS)
            h.update(f.read(BLOCK))
        f.seek(max(0, st.st_size - 2 ** 20))
        h.update(f.read(2 ** 20))
    return h.hexdigest()


def encoding_key(template, max_length: int, truncation_strategy: str) -> str:
    from swiftlite.data.encode import tokenizer_fingerprint
    return hashlib.sha256(json.dumps(
        [template.fingerprint(), template.loss_scale, max_length, truncation_strategy,
         tokenizer_fingerprint(template.tokenizer)]).encode()).hexdigest()[:24]


def _path(fkey: str) -> str:
    return os.path.join(cache_dir("datasets"), f"manifest-{fkey}.json")


def known(fkey: str | None) -> bool:
    return fkey is not None and os.path.exists(_path(fkey))


def lookup(fkey: str, ekey: str) -> dict | None:
    """{"load_report": ..., "train": entry path, "val": entry path or None}, when every entry
    it names is still complete."""
    try:
        with open(_path(fkey), encoding="utf-8") as f:
            entry = json.load(f).get(ekey)
    except (OSError, ValueError, AttributeError):
        return None
    if not entry:
        return None
    for part in ("train", "val"):
        p = entry.get(part)
        if p and not os.path.exists(os.path.join(p, "swiftlite_report.json")):
            return None  # swept or never finished
    return entry


def save(fkey: str, ekey: str, entry: dict) -> None:
    """Add an entry (atomically: a reader sees the old manifest or the new one)."""
    path = _path(fkey)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        data = data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        data = {}
    data[ekey] = entry
    write_json(path, data)
