"""runtime/atomic.py: a file is replaced whole or left as it was, and nothing is left beside it."""
from __future__ import annotations

import json
import threading

import pytest

from swiftlite.runtime.atomic import replacing, write_json, write_lines


def test_a_failed_write_leaves_the_old_file_and_nothing_beside_it(tmp_path):
    path = tmp_path / "state.json"
    write_json(str(path), {"step": 1})
    with pytest.raises(RuntimeError):
        with replacing(str(path)) as f:
            f.write('{"step": ')  # half of the new content, then the writer fails
            raise RuntimeError("disk full")
    assert json.loads(path.read_text()) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_writers_side_by_side_each_leave_a_whole_file(tmp_path):
    """Threads of one process (the Web-UI's) write under names of their own."""
    path = str(tmp_path / "rows.jsonl")
    rows = {n: [json.dumps({"writer": n, "i": i, "text": "é" * 200}) for i in range(200)]
            for n in range(8)}
    threads = [threading.Thread(target=write_lines, args=(path, rows[n])) for n in rows]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert lines in rows.values()
    assert [p.name for p in tmp_path.iterdir()] == ["rows.jsonl"]


def test_binary_content_and_fsync(tmp_path):
    path = tmp_path / "logps.bin"
    with replacing(str(path), "wb", fsync=True) as f:
        f.write(b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
