"""A C++ extension build that was killed leaves torch's lock file behind, and every later run
that needs the extension waited for it forever, printing nothing (runtime/build_locks.py)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from swiftlite.runtime import build_locks

BUILT = os.path.expanduser("~/.cache/torch_extensions")

LOAD_CPU_ADAM = textwrap.dedent("""
    from swiftlite.config.arguments import SftArguments
    from swiftlite.config.parsing import build
    from swiftlite.runtime import hardware
    from swiftlite.training.deepspeed import check_cpu_adam
    args = build(SftArguments, {"model": "tiny-qwen2", "dataset": ["x.jsonl"],
                                "deepspeed": "zero2_offload"})
    check_cpu_adam(args, hardware.detect())
    print("CPU Adam loaded")
""")


def _built_cpu_adam() -> str | None:
    found = [d for d in sorted(os.listdir(BUILT)) if os.path.isfile(
        os.path.join(BUILT, d, "cpu_adam", "cpu_adam.so"))] if os.path.isdir(BUILT) else []
    return os.path.join(BUILT, found[0]) if found else None


def test_a_lock_left_by_a_killed_build_no_longer_stops_a_deepspeed_run(tmp_path):
    """The run's own check of CPU Adam (ZeRO offload), with the lock of a killed build in the
    extension's folder: it loads the op and says which lock it removed."""
    built = _built_cpu_adam()
    if built is None:
        pytest.skip("DeepSpeed's CPU Adam is not built here (scripts/build_deepspeed_ops.py)")
    root = tmp_path / "torch_extensions"
    folder = root / "cpu_adam"  # with TORCH_EXTENSIONS_DIR set, torch builds in DIR/NAME
    shutil.copytree(os.path.join(built, "cpu_adam"), folder)  # keeps mtimes: nothing to rebuild
    (folder / "lock").touch()  # what a builder killed mid-build leaves: nobody holds it
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root), "DS_ACCELERATOR": "cpu"}
    try:
        done = subprocess.run([sys.executable, "-c", LOAD_CPU_ADAM], env=env, text=True,
                              capture_output=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("the run waited on the stale build lock (no output, no end)")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "CPU Adam loaded" in done.stdout
    assert f"removed {folder / 'lock'}" in done.stderr
    assert "killed before it finished" in done.stderr
    assert not (folder / "lock").exists()


def test_a_lock_that_a_live_build_holds_is_left_alone(tmp_path):
    """A build in progress (another rank, another run) holds its lock open: it stays, and so
    does the other run's wait for it."""
    lock = tmp_path / "py311_cpu" / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import os, sys, time\n"
         f"fd = os.open({str(lock)!r}, os.O_CREAT | os.O_EXCL)\n"  # as torch's FileBaton
         "print('held', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert build_locks.clear_stale(str(tmp_path), settle_s=0.1) == []
        assert lock.exists()
    finally:
        holder.kill()
        holder.wait()
    # its builder gone without removing it (killed): now it is stale
    assert build_locks.clear_stale(str(tmp_path), settle_s=0.1) == [str(lock)]
    assert not lock.exists()


def test_no_locks_no_wait(tmp_path):
    """The common case costs a glob: no locks, no /proc scan, no pause."""
    (tmp_path / "py311_cpu" / "cpu_adam").mkdir(parents=True)
    assert build_locks.clear_stale(str(tmp_path), settle_s=30) == []


def test_filesystem_types_come_from_the_mount_table(tmp_path):
    assert build_locks.filesystem("/proc/self") == "proc"
    assert build_locks.filesystem(str(tmp_path)) in build_locks.LOCAL_FILESYSTEMS


def test_a_lock_whose_builder_may_be_unseen_is_kept_and_explained(tmp_path, monkeypatch,
                                                                   capsys):
    """On NFS the builder may be a rank on another node, and another user's build is hidden
    from this process: such a lock is not removed; the run says which file it waits for and
    when to delete it. (A network filesystem cannot be mounted here, so its type is mocked.)
    Other extensions' locks are not this run's business."""
    folder = tmp_path / "py311_cpu" / "cpu_adam"
    folder.mkdir(parents=True)
    lock = folder / "lock"
    lock.touch()
    other = tmp_path / "py311_cpu" / "fused_adam" / "lock"
    other.parent.mkdir()
    other.touch()
    real = build_locks.filesystem
    monkeypatch.setattr(build_locks, "filesystem", lambda path: "nfs4")
    assert build_locks.clear_stale(str(tmp_path), settle_s=0) == []
    assert lock.exists() and other.exists()
    err = capsys.readouterr().err
    assert f"locked by {lock}" in err and "nfs4 filesystem that other machines may share" in err
    assert "delete that file" in err
    if os.getuid() == 0:  # another user's lock on a local filesystem
        monkeypatch.setattr(build_locks, "filesystem", real)
        os.chown(lock, 4242, -1)
        assert build_locks.clear_stale(str(tmp_path), settle_s=0) == []
        assert lock.exists() and "user id 4242" in capsys.readouterr().err
        os.chown(lock, 0, -1)
    monkeypatch.setattr(build_locks, "filesystem", real)
    assert build_locks.clear_stale(str(tmp_path), settle_s=0) == [str(lock)]
    assert other.exists()
