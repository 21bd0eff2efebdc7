"""Read ahead, on the other core, the files a training start reads from disk (#42).

A start of `swiftlite sft` reads about 0.6 GB of compiled libraries (torch's most of it), 0.1
GB of bytecode and the model's weights. Right after a run they are in the page cache; after a
minute of doing something else these machines have paged them out, and the start then waits
for them a few pages at a time, as the imports and the dynamic loader touch them, one after
the other. A helper process reads the same files front to back in large reads, while the
main process is busy importing on its own core, so most of its page faults find the pages in
memory (docs/performance.md has the cold and warm figures).

The helper is this file run by the same interpreter with -S (no site-packages, about 20 ms),
with the folders and files to read as arguments; it does nothing when the cache is warm (the
first of its files mostly resident), and it never affects the run: its output goes nowhere,
its errors end it. `SWIFTLITE_PREFETCH=0` turns it off. Asking the kernel to read ahead
(posix_fadvise WILLNEED) for every file at once was slower than no helper: the kernel queues
all of it before the main process's own reads.
"""
from __future__ import annotations

import os
import sys

ENV = "SWIFTLITE_PREFETCH"
LIST_ENV = "SWIFTLITE_PREFETCH_LIST"
LIST_ARG = "@"  # a helper argument naming a file of paths, one per line
# What a training command imports, roughly in the order it imports them: torch's libraries
# first, they are the largest and loaded at once.
PACKAGES = ("torch", "numpy", "transformers", "peft", "accelerate", "datasets", "pyarrow",
            "pandas", "tokenizers", "safetensors", "huggingface_hub", "sympy", "scipy")
MODEL_FILES = (".safetensors", "tokenizer.json")
READ = 1 << 20


def start(command: str, argv: list[str]) -> None:
    """Start the helper for a training command's `argv`: the files the last start of this
    command in this environment read (see `record`), else the folders of PACKAGES; then the
    --model folder's weights."""
    if os.environ.get(ENV, "1") == "0":
        return
    import hashlib
    import subprocess

    from swiftlite.runtime.paths import cache_dir
    key = hashlib.sha256(f"{sys.prefix}\0{command}".encode()).hexdigest()[:16]
    try:
        listing = os.path.join(cache_dir("prefetch"), f"{command}-{key}.txt")
        os.environ[LIST_ENV] = listing  # where this run's `record` writes
        roots = [LIST_ARG + listing] if os.path.isfile(listing) else package_dirs()
        subprocess.Popen([sys.executable, "-S", os.path.abspath(__file__),
                          *roots, *model_files(argv)],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, close_fds=True)
    except OSError:
        pass  # no cache folder or no helper: the start is as it was


def record() -> None:
    """Write down the files this process read to start (called when training has run, so the
    imports are done), in the order it needed them: its modules' bytecode and extension files
    in the order they were imported, each package's other shared libraries (torch's
    libtorch_cpu.so) just before its first module. Only in a run the command started the
    helper for."""
    listing = os.environ.get(LIST_ENV)
    if not listing:
        return
    try:
        with open("/proc/self/maps") as f:
            mapped = [line.split(None, 5)[-1].strip() for line in f]
    except OSError:
        return
    libs: dict[str, list[str]] = {}  # package folder -> its mapped libraries
    for path in dict.fromkeys(p for p in mapped if p.startswith("/") and ".so" in p):
        libs.setdefault(_package(path), []).append(path)
    order = []
    for m in list(sys.modules.values()):
        spec = getattr(m, "__spec__", None)
        path = getattr(spec, "cached", None) or getattr(spec, "origin", None) or ""
        if path.endswith((".pyc", ".so")) and os.path.isfile(path):
            order += libs.pop(_package(path), []) + [path]
    order += [p for rest in libs.values() for p in rest]
    tmp = f"{listing}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write("\n".join(dict.fromkeys(order)) + "\n")
        os.replace(tmp, listing)
    except OSError:
        pass


def _package(path: str) -> str:
    """The installed package a file belongs to: its folder under site-packages (`x.libs`
    counts as `x`), else its own folder."""
    head, sep, tail = path.partition("site-packages/")
    if not sep:
        return os.path.dirname(path)
    top = tail.split("/", 1)[0]
    return head + sep + top.removesuffix(".libs")


def package_dirs() -> list[str]:
    """The installed folders of PACKAGES (located, not imported), each followed by its
    `<name>.libs` folder where wheels keep bundled libraries."""
    from importlib.util import find_spec
    dirs = []
    for name in PACKAGES:
        try:
            spec = find_spec(name)
        except (ImportError, ValueError):
            continue
        for d in (spec.submodule_search_locations or []) if spec else []:
            dirs += [d] + ([d + ".libs"] if os.path.isdir(d + ".libs") else [])
    return dirs


def model_files(argv: list[str]) -> list[str]:
    """The weights and tokenizer of `--model DIR` when DIR is a local folder."""
    model = None
    for i, a in enumerate(argv):
        if a == "--model" and i + 1 < len(argv):
            model = argv[i + 1]
        elif a.startswith("--model="):
            model = a.split("=", 1)[1]
    if not model or not os.path.isdir(model):
        return []
    return sorted(os.path.join(model, n) for n in os.listdir(model) if n.endswith(MODEL_FILES))


def files_to_read(roots: list[str]) -> list[str]:
    """The shared libraries and bytecode under each folder of `roots` (libraries first within
    a folder), the paths listed in each `@FILE` of `roots`, and each file of `roots` itself, in
    the order given; each path once."""
    seen, out = set(), []
    for root in roots:
        if root.startswith(LIST_ARG):
            try:
                with open(root[len(LIST_ARG):]) as f:
                    found = f.read().split("\n")
            except OSError:
                found = []
            found = [p for p in found if ".so" in p] + [p for p in found if p.endswith(".pyc")]
        elif os.path.isfile(root):
            found = [root]
        else:
            libs, code = [], []
            for d, dirs, names in os.walk(root):
                dirs.sort()
                for n in sorted(names):
                    if ".so" in n:
                        libs.append(os.path.join(d, n))
                    elif n.endswith(".pyc"):
                        code.append(os.path.join(d, n))
            found = libs + code
        for path in found:
            if path not in seen:
                seen.add(path)
                out.append(path)
    return out


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _resident_share(path: str) -> float:
    """The share of `path`'s pages in the page cache (mincore), 0.0 if it cannot tell."""
    import ctypes
    import mmap
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if not size:
                return 0.0
            with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
                page = mmap.PAGESIZE
                vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
                anchor = ctypes.c_char.from_buffer(m)
                try:
                    libc = ctypes.CDLL(None, use_errno=True)
                    if libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)),
                                    ctypes.c_size_t(size), vec):
                        return 0.0
                finally:
                    del anchor
                return sum(b & 1 for b in vec) / len(vec)
    except (OSError, ValueError, AttributeError):
        return 0.0


def read_ahead(paths: list[str]) -> int:
    """Read each file front to back into one reused buffer; returns the bytes read. Nothing
    when the largest library (torch's) is already mostly in memory: the cache is warm."""
    libs = [p for p in paths if ".so" in p and os.path.isfile(p)] or paths
    if not paths or _resident_share(max(libs, key=_size)) > 0.5:
        return 0
    buf, total = bytearray(READ), 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            while (n := os.readv(fd, [buf])) == READ:
                total += n
            total += n
        except OSError:
            pass
        finally:
            os.close(fd)
    return total


if __name__ == "__main__":
    read_ahead(files_to_read(sys.argv[1:]))
