"""What the Infer and Export tabs offer to pick from: checkpoints found under the output root."""
from __future__ import annotations

import os

from swiftlite.webui.runs import checkpoints, find_runs


def all_checkpoints(root: str) -> list[str]:
    """Adapter and merged checkpoint folders of every run under root (newest run first)."""
    out = []
    for run in find_runs(root):
        out += reversed(checkpoints(run))
    return out


def is_adapter(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "adapter_config.json"))


def adapter_checkpoints(root: str) -> list[str]:
    return [c for c in all_checkpoints(root) if is_adapter(c)]


def labelled(root: str, paths: list[str]) -> list[tuple[str, str]]:
    """Dropdown choices: (path relative to the output root, absolute path)."""
    return [(os.path.relpath(p, root), p) for p in paths]
