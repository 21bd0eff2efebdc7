"""The fields of transformers' TrainingArguments, which `build` checks and converts the flags
it passes through by, without importing transformers on every start (#42).

Importing `transformers.TrainingArguments` takes seconds and imports peft and, through it,
bitsandbytes and torch's inductor: parsing a command line should not, so that a torchrun
launcher starts its ranks without it, a usage error comes at once, and a run decides what to
import (runtime/imports.py) once its arguments are known. The first parse with an installed
transformers imports it and keeps each field's annotation as text in the cache, keyed by the
file that defines them; later parses read that text. The text keeps what `convert` reads of
an annotation: unions, lists, dicts, None, Any, bool, int, float and str; any other class
(an enum, a Literal) becomes `object`, which `convert` treats as before (as text).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import types
import typing

from swiftlite.runtime.atomic import write_json
from swiftlite.runtime.paths import cache_dir

FORMAT = 1  # of the kept text: a change here makes new cache entries


def training_arguments_fields() -> dict[str, str]:
    """{field name: its annotation as text} for each field TrainingArguments' __init__ takes."""
    listing = _listing()
    if listing is not None:
        try:
            with open(listing, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            pass  # not written yet, or torn: import and write it
    from transformers import TrainingArguments
    fields = {f.name: annotation_text(f.type) for f in dataclasses.fields(TrainingArguments)
              if f.init}
    if listing is not None:
        try:
            write_json(listing, fields)  # whole or absent, with runs starting side by side
        except OSError:
            pass  # a read-only cache: the next start imports again
    return fields


def _listing() -> str | None:
    """The cache file for the installed transformers (None: not found, so import it)."""
    import importlib.util
    try:
        spec = importlib.util.find_spec("transformers")  # finds, does not import
        source = os.path.join(spec.submodule_search_locations[0], "training_args.py")
        st = os.stat(source)
        key = hashlib.sha256(f"{FORMAT}\0{source}\0{st.st_size}\0{st.st_mtime_ns}".encode())
        return os.path.join(cache_dir("transformers"),
                            f"training-arguments-{key.hexdigest()[:16]}.json")
    except (ImportError, AttributeError, TypeError, IndexError, OSError, ValueError):
        return None


def annotation_text(tp) -> str:
    """An annotation as text of builtins and typing names, for parsing.base_type and friends."""
    if tp is type(None) or tp is None:
        return "None"
    if tp is typing.Any:
        return "Any"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return "Union[" + ", ".join(annotation_text(a) for a in typing.get_args(tp)) + "]"
    if origin is list or tp is list:
        inner = typing.get_args(tp)
        return f"list[{annotation_text(inner[0])}]" if inner else "list"
    if origin is dict or tp is dict:
        return "dict"
    if tp in (bool, int, float, str):
        return tp.__name__
    return "object"
