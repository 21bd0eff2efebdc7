"""Sizes written by people -> bytes, and bytes -> text. Two readings of "GB", each for a
reason: memory (a GPU's, a node's) is advertised in binary units, so there GB means GiB;
files (safetensors shards) follow transformers' max_shard_size, where GB is 10^9."""
from __future__ import annotations

import re

from swiftlite.errors import UsageError


def parse_size(text) -> int:
    """A file size (--max_shard_size): '5GB' / '500MB' / '2GiB' / 1000000 -> bytes. GB is 10^9
    and GiB 2^30, as transformers' max_shard_size reads them."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*", str(text).lower())
    if not m:
        raise ValueError(f"expected a size such as 5GB or 500MB, got {text!r}")
    unit = m.group(2).rstrip("b")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
             "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}[unit]
    n = int(float(m.group(1)) * scale)
    if n <= 0:
        raise ValueError(f"the size must be positive, got {text!r}")
    return n


def gib(n: int | float) -> str:
    return f"{n / 2**30:.2f} GiB"


def parse_memory(text: str | int | float, flag: str) -> int:
    """A memory size (--gpu_memory, --cpu_memory): '24GB', '24GiB', '80G', '512MB' or a
    number of GiB -> bytes. GB is read as GiB, the way GPU memory is advertised (a "24 GB"
    card has 24 GiB)."""
    if isinstance(text, (int, float)):
        return int(text * 2**30)
    s = str(text).strip().upper().replace(" ", "")
    units = {"TIB": 2**40, "TB": 2**40, "T": 2**40, "GIB": 2**30, "GB": 2**30, "G": 2**30,
             "MIB": 2**20, "MB": 2**20, "M": 2**20, "B": 1}
    for unit, scale in units.items():
        if s.endswith(unit):
            s, mult = s[: -len(unit)], scale
            break
    else:
        mult = 2**30
    try:
        value = float(s)
    except ValueError:
        raise UsageError(f"--{flag} {text}: expected a size such as 24GB, 80GiB or 512MB.") \
            from None
    if value <= 0:
        raise UsageError(f"--{flag} {text}: must be positive.")
    return int(value * mult)
