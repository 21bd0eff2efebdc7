"""Validated rows kept cheaply: .jsonl rows as (file, byte offset, line), read back and
normalised again when asked for; and what a conversation or pair says (for cache keys)."""
from __future__ import annotations

import codecs
import json
import os
from array import array
from collections.abc import Sequence

from swiftlite.data.files import blocks
from swiftlite.data.formats import to_conversation
from swiftlite.data.pairs import KTO_FORMATS, PAIR_FORMATS, to_preference

def content(conv: dict) -> dict:
    """What a conversation or pair says, without where it came from (for cache keys)."""
    return {"messages": conv["messages"], "tools": conv.get("tools"),
            **{k: conv[k] for k in ("chosen", "rejected", "completion", "label") if k in conv}}


def convert(row, fmt: str, require_reply: bool = True) -> dict:
    """The canonical form of one row of a file in format fmt (a conversation, or a pair)."""
    if fmt in PAIR_FORMATS or fmt in KTO_FORMATS:
        return to_preference(row, fmt)
    return to_conversation(row, fmt, require_reply=require_reply)


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
                for block in blocks(f):
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
