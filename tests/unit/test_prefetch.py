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


def test_to_read_takes_the_recorded_list_then_plain_files_each_once(tmp_path):
    lib, code = _write(tmp_path / "libbig.so.1", 10), _write(tmp_path / "a.pyc", 10)
    weights = _write(tmp_path / "model.safetensors", 10)
    listing = tmp_path / "list.txt"
    listing.write_text(f"{lib}\t0-4096,8192-12288\n{code}\n")
    assert prefetch.to_read(["@" + str(listing), weights, code]) == [
        (lib, [(0, 4096), (8192, 12288)]), (code, None), (weights, None)]
    assert prefetch.to_read(["@" + str(tmp_path / "missing.txt"), weights]) == [(weights, None)]


def test_touched_pages_become_byte_ranges_joined_across_small_gaps():
    page, gap = prefetch.PAGE, prefetch.GAP
    assert prefetch._ranges([0, 1, 2, 2 + gap, 100 + 3 * gap]) == [
        (0, (3 + gap) * page), ((100 + 3 * gap) * page, (101 + 3 * gap) * page)]
    assert prefetch._ranges([]) == []


def test_model_files_are_the_local_model_folders_weights_and_tokenizer(tmp_path):
    model = tmp_path / "m"
    w = _write(model / "model.safetensors", 1)
    t = _write(model / "tokenizer.json", 1)
    _write(model / "config.json", 1)
    assert prefetch.model_files(["--model", str(model), "--max_steps", "1"]) == [w, t]
    assert prefetch.model_files([f"--model={model}"]) == [w, t]
    assert prefetch.model_files(["--model", "Qwen/Qwen2-0.5B"]) == []  # not a folder here
    assert prefetch.model_files([]) == []


def test_read_ahead_reads_cold_ranges_and_nothing_when_they_are_warm(tmp_path):
    lib = _write(tmp_path / "libx.so", 32 << 20)
    code = _write(tmp_path / "x.pyc", 1000)
    _evict(lib)
    if prefetch.resident_share(lib) > 0.5:
        pytest.skip("this file system keeps files in memory (tmpfs): nothing to evict")
    spans = [(0, 1 << 20), (2 << 20, 3 << 20)]
    assert prefetch.read_ahead([(lib, spans), (code, None)]) == (2 << 20) + 1000
    assert prefetch.resident_share(lib, spans) == 1.0
    # the rest is not read (beyond the kernel's own read-ahead window after the last range)
    assert prefetch.resident_share(lib, [(16 << 20, 32 << 20)]) < 0.5
    assert prefetch.read_ahead([(lib, spans), (code, None)]) == 0  # warm: nothing to do


def test_the_helper_runs_without_site_packages(tmp_path):
    """The command runs this file with `python -S`: it needs nothing but the standard library,
    and a missing file does not stop it."""
    lib = _write(tmp_path / "liby.so", 1 << 20)
    listing = tmp_path / "list.txt"
    listing.write_text(f"{tmp_path / 'missing.so'}\t0-4096\n{lib}\t0-{1 << 20}\n")
    _evict(lib)
    if prefetch.resident_share(lib) > 0.5:
        pytest.skip("this file system keeps files in memory (tmpfs): nothing to evict")
    subprocess.run([sys.executable, "-S", prefetch.__file__, "@" + str(listing)],
                   check=True, timeout=60)
    assert prefetch.resident_share(lib) == 1.0


def test_record_lists_the_touched_pages_of_libraries_then_bytecode_in_import_order(
        tmp_path, monkeypatch):
    import torch  # noqa: F401 (loaded: its libraries are mapped, its modules imported)
    listing = tmp_path / "sft.txt"
    monkeypatch.setenv(prefetch.LIST_ENV, str(listing))
    prefetch.record()
    items = prefetch.to_read(["@" + str(listing)])
    paths = [p for p, _ in items]
    assert len(paths) == len(set(paths)) and all(os.path.isfile(p) for p in paths)
    spans = dict(items)[next(p for p in paths if os.path.basename(p) == "libtorch_cpu.so")]
    size = os.path.getsize(next(p for p in paths if os.path.basename(p) == "libtorch_cpu.so"))
    touched = sum(b - a for a, b in spans)
    assert 0 < touched < size  # the pages this process touched, not the whole library
    assert all(a < b <= c for (a, b), (c, _) in zip(spans, spans[1:]))
    code = [p for p, s in items if s is None]
    assert code and all(p.endswith(".pyc") for p in code)
    assert paths.index(code[0]) > max(i for i, (_, s) in enumerate(items) if s)  # libs first
    init = code.index(next(p for p in code if p.endswith(
        f"torch/__pycache__/__init__.{sys.implementation.cache_tag}.pyc")))
    nn = code.index(next(p for p in code if "/torch/nn/__pycache__/__init__." in p))
    assert init < nn
    monkeypatch.delenv(prefetch.LIST_ENV)
    listing.unlink()
    prefetch.record()  # not started by a command: writes nothing
    assert not listing.exists()


def test_the_first_start_writes_the_list_and_starts_no_helper(monkeypatch, tmp_path):
    monkeypatch.setenv("SWIFTLITE_CACHE", str(tmp_path))
    monkeypatch.delenv(prefetch.ENV, raising=False)
    monkeypatch.delenv(prefetch.LIST_ENV, raising=False)
    started = []
    monkeypatch.setattr("subprocess.Popen", lambda *a, **k: started.append(a))
    prefetch.start("sft", [])
    listing = os.environ[prefetch.LIST_ENV]
    assert os.path.dirname(listing) == str(tmp_path / "prefetch") and not started
    open(listing, "w").close()
    prefetch.start("sft", ["--model", str(tmp_path)])
    [(cmd,)] = started
    assert cmd[1:3] == ["-S", prefetch.__file__] and cmd[3] == "@" + listing


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


def test_record_never_fails_the_run_it_is_called_from(monkeypatch, tmp_path):
    """A module object whose attributes raise is skipped; a list that cannot be written is
    not written, and nothing is raised."""
    class Odd:
        def __getattr__(self, name):
            raise RuntimeError("lazy module")
    monkeypatch.setitem(sys.modules, "swiftlite_test_odd_module", Odd())
    monkeypatch.setenv(prefetch.LIST_ENV, str(tmp_path / "sft.txt"))
    prefetch.record()
    assert any(s is None for _, s in prefetch.to_read(["@" + str(tmp_path / "sft.txt")]))
    monkeypatch.setenv(prefetch.LIST_ENV, str(tmp_path / "missing-folder" / "sft.txt"))
    prefetch.record()
    assert not (tmp_path / "missing-folder").exists()
