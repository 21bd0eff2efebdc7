"""Progress messages for people: to stderr, prefixed, only from the main process."""
import os
import sys


def is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def info(msg: str) -> None:
    if is_main_process():
        print(f"[swiftlite] {msg}", file=sys.stderr, flush=True)


def warn(msg: str) -> None:
    if is_main_process():
        print(f"[swiftlite] WARNING: {msg}", file=sys.stderr, flush=True)
