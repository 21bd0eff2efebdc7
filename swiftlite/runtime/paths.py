"""Where swiftlite keeps its caches (models it builds, tokenised datasets)."""
import os


def cache_dir(*parts: str) -> str:
    root = os.environ.get("SWIFTLITE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "swiftlite")
    path = os.path.join(root, *parts)
    os.makedirs(path, exist_ok=True)
    return path
