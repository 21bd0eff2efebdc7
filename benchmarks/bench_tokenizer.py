"""Tokenizer loads in one process: the first load of a folder, then loads of the same folder again
(what the Python API does running sft, merge, infer and eval one after another), through
swiftlite's load_tokenizer and through transformers' AutoTokenizer alone. One JSON line per
model:

  python benchmarks/bench_tokenizer.py [--models tiny-qwen2 SmolLM2-135M-Instruct] [--again 3]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time


def _seconds(load, folder: str) -> float:
    start = time.perf_counter()
    load(folder)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny-qwen2", "tiny-qwen3",
                                                        "SmolLM2-135M-Instruct"])
    parser.add_argument("--again", type=int, default=3, help="loads after the first")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from swiftlite.models.builtin import build
    from swiftlite.models.loader import load_tokenizer
    from swiftlite.runtime.hardware import describe_cpu
    for alias in args.models:
        folder = build(alias)
        row = {"model": alias, "tokenizer_json_mb": round(
            os.path.getsize(os.path.join(folder, "tokenizer.json")) / 2**20, 1)}
        for name, load in (("transformers", AutoTokenizer.from_pretrained),
                           ("swiftlite", load_tokenizer)):
            first = _seconds(load, folder)
            again = [_seconds(load, folder) for _ in range(args.again)]
            row[name] = {"first_s": round(first, 3), "again_s": round(max(again), 4)}
        row.update(cpu=describe_cpu(), python=platform.python_version())
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
