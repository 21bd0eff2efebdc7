"""The building blocks of every command's arguments: `arg` (a dataclass field with its
help text, choices and Web-UI group) and the checks that collect problems for one UsageError."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import field

from swiftlite.errors import UsageError


def arg(default=None, help: str = "", *, choices=None, group: str = "", factory=None):
    meta = {"help": help, "choices": choices, "group": group}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def same_as(owner, name: str, **changes):
    """The field `name` of the dataclass `owner` (its default, help text, choices and group;
    `changes` replaces some of those), for a command that takes the same flag: one help text
    per flag."""
    f = next(f for f in dataclasses.fields(owner) if f.name == name)
    meta = {**f.metadata, **{k: v for k, v in changes.items() if k != "default"}}
    if "default" in changes:
        return field(default=changes["default"], metadata=meta)
    if f.default_factory is not dataclasses.MISSING:
        return field(default_factory=f.default_factory, metadata=meta)
    return field(default=f.default, metadata=meta)


def not_positive(obj, names) -> list[str]:
    return [f"--{n} must be a positive number, got {getattr(obj, n)}" for n in names
            if getattr(obj, n) <= 0]


def not_finite(obj) -> list[str]:
    """nan or inf in a float field (parsing refuses them; this catches dataclasses built
    directly in Python)."""
    return [f"--{f.name} must be a finite number, got {getattr(obj, f.name)}"
            for f in dataclasses.fields(obj) if isinstance(getattr(obj, f.name), float)
            and not math.isfinite(getattr(obj, f.name))]


def raise_if(problems: list[str]) -> None:
    """One UsageError listing every problem found, so a user fixes them all at once."""
    if problems:
        raise UsageError("invalid arguments:\n  - " + "\n  - ".join(problems))


def check_choices(obj) -> list[str]:
    out = []
    for f in dataclasses.fields(obj):
        choices = f.metadata.get("choices")
        if choices and getattr(obj, f.name) not in choices:
            out.append(f"--{f.name} {getattr(obj, f.name)}: choose one of {', '.join(choices)}")
    return out
