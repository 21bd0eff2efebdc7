"""The read-ahead helper of a training start (runtime/prefetch.py): what it reads, in which
order, that it reads only when the cache is cold, and what a run writes down for the next."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from swiftlite.runtime import prefetch


def _write(path, size: int) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size))
    return str(path)


def _evict(path: str) -> None:
    """Drop `path`'s pages from the page cache (written back first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_files_to_read_puts_libraries_first_and_lists_each_file_once(tmp_path):
    pkg = tmp_path / "site-packages" / "pkg"
    code = _write(pkg / "__pycache__" / "a.cpython-311.pyc", 10)
    lib = _write(pkg / "lib" / "libbig.so.1", 10)
    _write(pkg / "README.md", 10)  # neither code nor a library: not read
    weights = _write(tmp_path / "model" / "model.safetensors", 10)
    listing = tmp_path / "list.txt"
    listing.write_text("\n".join([code, lib, str(tmp_path / "gone.pyc")]) + "\n")
    assert prefetch.files_to_read([str(pkg), weights]) == [lib, code, weights]
    # a recorded list: its libraries before its bytecode, paths already seen not again
    assert prefetch.files_to_read(["@" + str(listing), weights]) == [
        lib, code, str(tmp_path / "gone.pyc"), weights]
    assert prefetch.files_to_read([str(pkg), "@" + str(listing)]) == [lib, code,
                                                                       str(tmp_path / "gone.pyc")]


def test_model_files_are_the_local_model_folders_weights_and_tokenizer(tmp_path):
    model = tmp_path / "m"
    w = _write(model / "model.safetensors", 1)
    t = _write(model / "tokenizer.json", 1)
    _write(model / "config.json", 1)
    assert prefetch.model_files(["--model", str(model), "--max_steps", "1"]) == [w, t]
    assert prefetch.model_files([f"--model={model}"]) == [w, t]
    assert prefetch.model_files(["--model", "Qwen/Qwen2-0.5B"]) == []  # not a folder here
    assert prefetch.model_files([]) == []


def test_package_dirs_are_located_without_importing():
    code = ("import sys\nfrom swiftlite.runtime import prefetch\nd = prefetch.package_dirs()\n"
            "print(any(x.endswith('/torch') for x in d), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"]


def test_read_ahead_reads_a_cold_library_and_nothing_when_it_is_warm(tmp_path):
    lib = _write(tmp_path / "libx.so", 4 << 20)
    code = _write(tmp_path / "x.pyc", 1000)
    _evict(lib)
    if prefetch._resident_share(lib) > 0.5:
        pytest.skip("this file system keeps files in memory (tmpfs): nothing to evict")
    assert prefetch.read_ahead([lib, code]) == (4 << 20) + 1000
    assert prefetch._resident_share(lib) == 1.0
    assert prefetch.read_ahead([lib, code]) == 0  # warm: the helper ends at once


def test_the_helper_runs_without_site_packages(tmp_path):
    """The command runs this file with `python -S`: it needs nothing but the standard library,
    and a missing file does not stop it."""
    lib = _write(tmp_path / "liby.so", 1 << 20)
    _evict(lib)
    subprocess.run([sys.executable, "-S", prefetch.__file__, str(tmp_path / "missing.so"), lib],
                   check=True, timeout=60)
    if prefetch._resident_share(lib) == 0.0:
        pytest.skip("mincore reports nothing here")
    assert prefetch._resident_share(lib) == 1.0


def test_record_lists_this_process_libraries_and_bytecode_in_import_order(tmp_path, monkeypatch):
    import torch  # noqa: F401 (loaded: its libraries are mapped, its modules imported)
    listing = tmp_path / "sft.txt"
    monkeypatch.setenv(prefetch.LIST_ENV, str(listing))
    prefetch.record()
    paths = listing.read_text().split()
    assert len(paths) == len(set(paths)) and all(os.path.isfile(p) for p in paths)
    cpu = next(i for i, p in enumerate(paths) if os.path.basename(p) == "libtorch_cpu.so")
    first_torch_code = next(i for i, p in enumerate(paths)
                            if "/torch/" in p and p.endswith(".pyc"))
    assert cpu < first_torch_code  # a package's libraries just before its first module
    order = [p for p in paths if p.endswith(".pyc")]
    init = next(i for i, p in enumerate(order) if p.endswith("torch/__pycache__/__init__."
                                                              f"{sys.implementation.cache_tag}.pyc"))
    nn = next(i for i, p in enumerate(order) if "/torch/nn/__pycache__/__init__." in p)
    assert init < nn
    monkeypatch.delenv(prefetch.LIST_ENV)
    listing.unlink()
    prefetch.record()  # not started by a command: writes nothing
    assert not listing.exists()


def test_off_switch(monkeypatch, tmp_path):
    monkeypatch.setenv(prefetch.ENV, "0")
    monkeypatch.setenv("SWIFTLITE_CACHE", str(tmp_path))
    monkeypatch.delenv(prefetch.LIST_ENV, raising=False)
    prefetch.start("sft", [])
    assert prefetch.LIST_ENV not in os.environ and not (tmp_path / "prefetch").exists()


def test_an_unwritable_cache_leaves_the_start_as_it_was(monkeypatch, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("SWIFTLITE_CACHE", str(blocked / "cache"))  # cannot be made
    monkeypatch.delenv(prefetch.ENV, raising=False)
    monkeypatch.delenv(prefetch.LIST_ENV, raising=False)
    prefetch.start("sft", [])  # no error
    assert prefetch.LIST_ENV not in os.environ
