"""Read ahead, on the other core, what a training start reads from disk (#42).

A start of `swiftlite sft` reads about 0.6 GB of compiled libraries (torch's most of it), 0.1
GB of bytecode and the model's weights. Right after a run they are in the page cache; after a
minute of doing something else these machines have paged them out, and the start then waits
for them a few pages at a time, as the imports and the dynamic loader touch them, one after
the other. A helper process reads the same bytes in large reads, libraries first, while the
main process is busy importing on its own core, so most of its page faults find the pages in
memory (docs/performance.md has the figures).

What to read is what the last start of the same command in the same environment used: after
training, `record` writes down the pages of each shared library this process mapped
(/proc/self/pagemap, as byte ranges of the file) and the bytecode of its modules in the order
they were imported. Only those: reading whole libraries (libtorch_cpu.so is 434 MB, of which a
start touches 265) made a cold start slower on a disk limited to 150 MB/s. The first start in
an environment has no list and no helper (its files were just installed, so they are cached).

The helper is this file run by the same interpreter with -S (no site-packages), with the list
as argument; it does nothing when the cache is warm (the listed pages of the largest library
mostly resident), and never affects the run: its output goes nowhere, its errors end it.
`SWIFTLITE_PREFETCH=0` turns it off. Asking the kernel to read ahead (posix_fadvise WILLNEED)
for every file at once was slower than no helper: the kernel queued all of it before the main
process's own reads; so was reading in import order (the helper read each file when the start
did).
"""
from __future__ import annotations

import os
import sys

ENV = "SWIFTLITE_PREFETCH"
LIST_ENV = "SWIFTLITE_PREFETCH_LIST"
LIST_ARG = "@"  # a helper argument naming a recorded list
MODEL_FILES = (".safetensors", "tokenizer.json")
READ = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
GAP = 32  # pages: touched pages this close together are read as one range


def start(command: str, argv: list[str]) -> None:
    """Start the helper for a training command's `argv`: the pages and files the last start of
    this command in this environment read (see `record`), then the --model folder's weights."""
    if os.environ.get(ENV, "1") == "0":
        return
    import hashlib
    import subprocess

    from swiftlite.runtime.paths import cache_dir
    key = hashlib.sha256(f"{sys.prefix}\0{command}".encode()).hexdigest()[:16]
    try:
        listing = os.path.join(cache_dir("prefetch"), f"{command}-{key}.txt")
        os.environ[LIST_ENV] = listing  # where this run's `record` writes
        if not os.path.isfile(listing):
            return  # the first start here: it writes down what it reads, for the next
        subprocess.Popen([sys.executable, "-S", os.path.abspath(__file__),
                          LIST_ARG + listing, *model_files(argv)],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, close_fds=True)
    except OSError:
        pass  # no cache folder or no helper: the start is as it was


def record() -> None:
    """Write down what this process read to start (called when training has run, so the
    imports are done): the touched pages of each mapped shared library, each package's
    libraries just before its first module, then the bytecode of the modules in the order they
    were imported. Only in a run the command started (or would have started) the helper for."""
    listing = os.environ.get(LIST_ENV)
    if not listing:
        return
    try:
        _record(listing)
    except Exception:  # noqa: BLE001 (a list for the next start must not fail a finished run)
        pass


def _record(listing: str) -> None:
    libs = _touched_libraries()
    by_package: dict[str, list[str]] = {}
    for path in libs:
        by_package.setdefault(_package(path), []).append(path)
    order, code = [], []
    for m in list(sys.modules.values()):
        try:
            spec = getattr(m, "__spec__", None)
            path = getattr(spec, "cached", None) or getattr(spec, "origin", None) or ""
        except Exception:  # noqa: BLE001 (a module object whose attributes raise: skipped)
            continue
        if path.endswith((".pyc", ".so")) and os.path.isfile(path):
            order += by_package.pop(_package(path), [])
            if path.endswith(".pyc"):
                code.append(path)
    order += [p for rest in by_package.values() for p in rest]
    lines = [f"{p}\t{_format(libs[p])}" for p in dict.fromkeys(order) if p in libs] + code
    from swiftlite.runtime.atomic import write_lines  # not at the top: the helper runs alone (-S)
    write_lines(listing, lines)


def _touched_libraries() -> dict[str, list[tuple[int, int]]]:
    """Each shared library mapped into this process -> the byte ranges of it whose pages are
    mapped (touched), from /proc/self/maps and /proc/self/pagemap."""
    pages: dict[str, set[int]] = {}
    with open("/proc/self/maps") as maps, open("/proc/self/pagemap", "rb") as pagemap:
        for line in maps:
            fields = line.split(None, 5)
            if len(fields) < 6 or not fields[5].startswith("/") or ".so" not in fields[5]:
                continue
            path = fields[5].strip()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            first = int(fields[2], 16) // PAGE  # the mapping's first page in the file
            entries = memoryview(os.pread(pagemap.fileno(), (hi - lo) // PAGE * 8,
                                          lo // PAGE * 8)).cast("Q")
            touched = pages.setdefault(path, set())
            touched.update(first + i for i, e in enumerate(entries) if e >> 63)
    return {path: _ranges(sorted(p)) for path, p in pages.items() if p}


def _ranges(pages: list[int]) -> list[tuple[int, int]]:
    """Sorted page numbers -> byte ranges [start, end), pages within GAP of each other joined."""
    out: list[list[int]] = []
    for p in pages:
        if out and p - out[-1][1] <= GAP:
            out[-1][1] = p + 1
        else:
            out.append([p, p + 1])
    return [(a * PAGE, b * PAGE) for a, b in out]


def _format(ranges: list[tuple[int, int]]) -> str:
    return ",".join(f"{a}-{b}" for a, b in ranges)


def _package(path: str) -> str:
    """The installed package a file belongs to: its folder under site-packages (`x.libs`
    counts as `x`), else its own folder."""
    head, sep, tail = path.partition("site-packages/")
    if not sep:
        return os.path.dirname(path)
    top = tail.split("/", 1)[0]
    return head + sep + top.removesuffix(".libs")


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


def to_read(args: list[str]) -> list[tuple[str, list[tuple[int, int]] | None]]:
    """The helper's arguments -> (path, byte ranges or None for the whole file), in order:
    each `@LIST`'s libraries (their recorded ranges), then its bytecode, and each plain path;
    each path once."""
    out, seen = [], set()
    for arg in args:
        entries = []
        if arg.startswith(LIST_ARG):
            try:
                with open(arg[len(LIST_ARG):]) as f:
                    for line in f.read().splitlines():
                        path, _, spans = line.partition("\t")
                        entries.append((path, [tuple(map(int, s.split("-")))
                                               for s in spans.split(",")] if spans else None))
            except (OSError, ValueError):
                entries = []
        else:
            entries = [(arg, None)]
        for path, spans in entries:
            if path and path not in seen:
                seen.add(path)
                out.append((path, spans))
    return out


def resident_share(path: str, spans: list[tuple[int, int]] | None = None) -> float:
    """The share of `path`'s pages (those in `spans`, else all) in the page cache (mincore);
    0.0 if it cannot tell."""
    import ctypes
    import mmap
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if not size:
                return 0.0
            with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
                vec = (ctypes.c_ubyte * ((size + PAGE - 1) // PAGE))()
                anchor = ctypes.c_char.from_buffer(m)
                try:
                    libc = ctypes.CDLL(None, use_errno=True)
                    if libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)),
                                    ctypes.c_size_t(size), vec):
                        return 0.0
                finally:
                    del anchor
    except (OSError, ValueError, AttributeError):
        return 0.0
    pages = [p for a, b in (spans or [(0, size)]) for p in range(a // PAGE, -(-b // PAGE))
             if p < len(vec)]
    return sum(vec[p] & 1 for p in pages) / len(pages) if pages else 0.0


def read_ahead(items: list[tuple[str, list[tuple[int, int]] | None]]) -> int:
    """Read each (path, ranges) front to back into one reused buffer; returns the bytes read.
    Nothing when the largest library's listed pages are mostly in memory: the cache is warm."""
    if not items:
        return 0
    libs = [(p, s) for p, s in items if ".so" in p] or items
    path, spans = max(libs, key=lambda it: sum(b - a for a, b in it[1]) if it[1] else _size(it[0]))
    if resident_share(path, spans) > 0.5:
        return 0
    buf, total = bytearray(READ), 0
    for path, spans in items:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            for a, b in spans or [(0, os.fstat(fd).st_size)]:
                while a < b:
                    n = os.preadv(fd, [memoryview(buf)[:min(READ, b - a)]], a)
                    if n <= 0:
                        break
                    a += n
                    total += n
        except OSError:
            pass
        finally:
            os.close(fd)
    return total


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


if __name__ == "__main__":
    read_ahead(to_read(sys.argv[1:]))
