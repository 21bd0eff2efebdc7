"""--packing: samples packed into rows of up to max_length tokens, for fewer, fuller steps.

Which samples share a row is decided once, over every sample's length, by best-fit
decreasing: longest first, each into the fullest row it still fits in. A packed row keeps its
samples apart exactly as a padding-free batch does (DataCollatorWithFlattening): position ids
restart at 0 for each sample, so attention (flash-attention's varlen kernels, swiftlite's
sdpa_packed) stays inside it, and each sample's first label is ignored, so no token learns to
predict the next sample. The loss per trained token is the one of unpacked training.

The rows are read from the memory-mapped encoded dataset when asked for: packing copies
nothing, and a batch of B packed rows is collated into one row of their concatenation.
"""
from __future__ import annotations

import bisect

from swiftlite.config.constants import IGNORE_INDEX


def pack(lengths: list[int], max_length: int) -> list[list[int]]:
    """Groups of sample indices whose lengths sum to at most max_length (best-fit
    decreasing; a sample longer than max_length gets a row of its own)."""
    rows: list[list[int]] = []
    room_of: dict[int, list[int]] = {}  # free tokens -> rows with exactly that many free
    rooms: list[int] = []  # the keys of room_of, sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        k = bisect.bisect_left(rooms, n)
        if k == len(rooms):
            row, room = len(rows), max_length - n
            rows.append([i])
        else:
            free = rooms[k]
            row = room_of[free].pop()
            if not room_of[free]:
                del room_of[free], rooms[k]
            rows[row].append(i)
            room = free - n
        if room > 0:
            if room not in room_of:
                room_of[room] = []
                bisect.insort(rooms, room)
            room_of[room].append(row)
    return rows


class PackedDataset:
    """A map-style dataset of packed rows over an encoded dataset (input_ids/labels): each
    item is {'input_ids', 'labels', 'position_ids'} of its samples, one after another."""

    def __init__(self, encoded, lengths: list[int], max_length: int):
        self.encoded = encoded.select_columns(["input_ids", "labels"])
        self.groups = pack(lengths, max_length)
        self.stats = {"samples": len(lengths), "rows": len(self.groups),
                      "max_length": max_length,
                      "efficiency": round(sum(lengths) / (len(self.groups) * max_length), 4)}

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, i: int) -> dict:
        part = self.encoded[self.groups[i]]
        ids, labels, positions = [], [], []
        for sample_ids, sample_labels in zip(part["input_ids"], part["labels"]):
            _append(ids, labels, positions, sample_ids, sample_labels)
        return {"input_ids": ids, "labels": labels, "position_ids": positions}

    def describe(self) -> str:
        s = self.stats
        return (f"packing: {s['samples']} samples into {s['rows']} rows of up to "
                f"{s['max_length']} tokens; efficiency {100 * s['efficiency']:.1f}% (real "
                "tokens / row slots)")


def collate(features: list[dict]) -> dict:
    """Packed rows -> one row of their concatenation ([1, total] tensors), as
    DataCollatorWithFlattening makes of unpacked samples (which evaluation, unpacked, gets
    here too): the position ids of a packed row are kept."""
    import torch
    ids, labels, positions = [], [], []
    for f in features:
        if "position_ids" in f:
            ids += f["input_ids"]
            labels += f["labels"]
            positions += f["position_ids"]
        else:
            _append(ids, labels, positions, f["input_ids"], f["labels"])
    return {"input_ids": torch.tensor([ids]), "labels": torch.tensor([labels]),
            "position_ids": torch.tensor([positions])}


def _append(ids: list, labels: list, positions: list, sample_ids, sample_labels) -> None:
    """One sample onto a packed row: its positions restart at 0, its first label is ignored."""
    ids += sample_ids
    labels += [IGNORE_INDEX] + list(sample_labels[1:])
    positions += range(len(sample_ids))
