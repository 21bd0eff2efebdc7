"""tcmalloc for the commands that train or run a model (Linux), when the system has it.

PyTorch's CPU tensors come from the C library's malloc. glibc's malloc serves the short-lived
activation buffers of forward/backward from its heap, and the long-lived tensors that
gradient checkpointing keeps between them (each layer's input) split that heap into holes it
cannot give back: one SmolLM2-135M LoRA step of 1,600 tokens left a 2.3 GB heap of which
2.1 GB was free (mallinfo2), and peak RSS was 3.3 GB for 1.3 GB of live data. Making glibc
map large blocks separately (MALLOC_MMAP_THRESHOLD_) frees them but makes the steps 2x slower
(a page fault per 4 KiB touched). tcmalloc keeps freed memory in size classes it reuses: the
same five steps peaked at 1.4 GB and ran 9% faster (measurements in docs/performance.md).

The allocator has to be in place before the process' first malloc, so `swiftlite sft`,
`infer` and `merge-lora` re-execute themselves once with tcmalloc in LD_PRELOAD (about 50 ms,
before torch is imported); torchrun ranks and Web-UI runs inherit it. Nothing changes when
the library is missing (Debian/Ubuntu: `apt-get install libtcmalloc-minimal4`), and
SWIFTLITE_ALLOCATOR=glibc keeps the system allocator.
"""
from __future__ import annotations

import ctypes.util
import glob
import os
import sys

ENV = "SWIFTLITE_ALLOCATOR"  # "glibc": leave malloc alone; otherwise tcmalloc when found
NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
        "/usr/local/lib", os.path.join(sys.prefix, "lib"))
INSTALL_HINT = "apt-get install libtcmalloc-minimal4"


def find_tcmalloc() -> str | None:
    """Path of a tcmalloc shared library on this system, or None."""
    for d in DIRS:
        for name in NAMES:
            path = os.path.join(d, name)
            if os.path.exists(path):
                return path
    found = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    if found:  # a bare soname: the dynamic loader finds it the same way LD_PRELOAD will
        return found
    return next(iter(glob.glob("/usr/lib/*/libtcmalloc*.so.4")), None)


def active() -> str:
    """The allocator of this process: "tcmalloc" or "glibc" (read from its memory map)."""
    try:
        with open("/proc/self/maps") as f:
            return "tcmalloc" if "libtcmalloc" in f.read() else "glibc"
    except OSError:
        return "glibc"


def reexec_with_tcmalloc(args: list[str]) -> None:
    """Replace this process with `python ARGS` under tcmalloc (the CLI: `-m swiftlite.cli
    ...`; a script: its path and arguments), when wanted and possible; otherwise return and go
    on with the current allocator."""
    if not sys.platform.startswith("linux") or os.environ.get(ENV, "").lower() == "glibc":
        return
    if os.environ.get(ENV) == "tcmalloc" or active() == "tcmalloc":
        return  # already re-executed (or preloaded by the user): never loop
    lib = find_tcmalloc()
    if lib is None:
        return
    preload = os.environ.get("LD_PRELOAD")
    env = {**os.environ, ENV: "tcmalloc", "LD_PRELOAD": f"{lib}:{preload}" if preload else lib,
           # tcmalloc reports every allocation over 1 GiB on stderr; a long prompt's logits are
           # such an allocation and not worth a line.
           "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40)}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *args], env)


# oneDNN, which runs torch's bf16 matmuls on a CPU, keeps a compiled primitive per matmul
# shape, and ideep, the layer torch calls it through, keeps one more; each cache holds 1,024
# entries by default, about 0.6 MB per new token count for SmolLM2-135M's layer shapes. A
# padding-free batch has a new token count nearly every step, so memory grew all run long
# (30 steps: +380 MB). A step needs about 16 shapes; building a primitive again takes under a
# millisecond. Both caches read their size from the environment when first used.
ONEDNN_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
ONEDNN_CACHE_ENTRIES = 64


def bound_onednn_caches() -> None:
    """Bound oneDNN's and ideep's primitive caches (a user's own setting wins). Takes effect
    if called before this process's first oneDNN matmul: loading a model does it."""
    for name in ONEDNN_CACHES:
        os.environ.setdefault(name, str(ONEDNN_CACHE_ENTRIES))


def describe_onednn_caches() -> str:
    """One line for a CPU run's log: the primitive caches' size and where it comes from."""
    sizes = {name: os.environ.get(name, str(ONEDNN_CACHE_ENTRIES)) for name in ONEDNN_CACHES}
    return ("oneDNN primitive caches: " + ", ".join(f"{n}={v}" for n, v in sizes.items())
            + " (bounded: one entry per matmul shape, and a padding-free batch brings new shapes"
              " every step)")


def describe() -> str:
    """One line for the run log: which allocator, and how to change it."""
    if not sys.platform.startswith("linux"):
        return "memory allocator: the system's"
    if active() == "tcmalloc":
        return f"memory allocator: tcmalloc ({ENV}=glibc for the system's)"
    if os.environ.get(ENV, "").lower() == "glibc":
        return f"memory allocator: glibc ({ENV}=glibc)"
    lib = find_tcmalloc()
    if lib:  # installed, but this process was not started as the `swiftlite` command
        return ("memory allocator: glibc; peak memory is about 2x lower with tcmalloc: start "
                f"Python with LD_PRELOAD={lib}")
    return ("memory allocator: glibc; peak memory is about 2x lower with tcmalloc "
            f"({INSTALL_HINT})")


def peak_rss_bytes() -> int:
    """This process's peak resident memory. VmHWM, not ru_maxrss: Linux carries ru_maxrss over
    exec, so a process started from a bigger one (pytest, the Web-UI, a benchmark driver)
    would report its parent's size."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):  # not Linux: ru_maxrss is KiB on Linux, bytes on macOS
        import resource
        import sys
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
