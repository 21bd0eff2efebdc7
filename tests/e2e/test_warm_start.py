"""The suite's warm start (helpers/warm_start.py) runs `swiftlite` as a fresh process does, and
leaves to a fresh process every run it cannot start as one."""
from __future__ import annotations

import json
import os
import re

import pytest

from helpers import warm_start
from helpers.cli import CHAT_ROWS, run_cli, write_jsonl


def _log_lines(stderr: str) -> list[str]:
    """swiftlite's own lines, with what differs between any two runs masked (times, rates,
    paths) or left out (the fp32 matmul library, chosen by a race measured at each start)."""
    lines = [line for line in stderr.splitlines()
             if line.startswith("[swiftlite]") and "measured here" not in line]
    return [re.sub(r"\d+(\.\d+)?", "N", re.sub(r"/\S+", "PATH", line)) for line in lines]


def _losses(output_dir) -> list[float]:
    with open(os.path.join(output_dir, "logging.jsonl")) as f:
        return [row["loss"] for row in map(json.loads, f) if "loss" in row]


def test_a_forked_run_trains_and_speaks_as_a_fresh_process(tiny_qwen2, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", CHAT_ROWS)
    argv = ("sft", "--model", "tiny-qwen2", "--dataset", data, "--max_steps", "3",
            "--logging_steps", "1", "--report_to", "none", "--add_version", "false",
            "--load_from_cache_file", "false")  # each encodes its rows: the same lines
    forked = warm_start.forked
    warm = run_cli(*argv, "--output_dir", tmp_path / "warm")
    assert warm_start.forked == forked + 1, "the run did not go through the warm start"
    fresh = run_cli(*argv, "--output_dir", tmp_path / "fresh", env={"SWIFTLITE_TEST_WARM": "0"})
    assert warm_start.forked == forked + 1, "a run with its own environment must start fresh"
    assert _losses(tmp_path / "warm") == pytest.approx(_losses(tmp_path / "fresh"), abs=1e-5)
    assert _log_lines(warm.stderr) == _log_lines(fresh.stderr)
    assert "memory allocator: tcmalloc" in warm.stderr  # swiftlite's own re-execution's


def test_a_run_that_needs_a_library_the_server_left_out_runs_fresh(tiny_qwen2, tmp_path):
    # --deepspeed: the training server has DeepSpeed left out, as a plain run has; this run
    # needs it, says so when it decides (before anything else) and goes to a fresh process,
    # which stops at the bad row, as every run does before it loads a model.
    data = write_jsonl(tmp_path / "d.jsonl", [CHAT_ROWS[0], '{"messages": 5}'])
    forked = warm_start.forked
    r = run_cli("sft", "--model", "tiny-qwen2", "--dataset", data, "--deepspeed", "zero2",
                "--output_dir", tmp_path / "out", check=False)
    assert warm_start.forked == forked
    assert r.returncode == 2 and f"{data}:2" in r.stderr, r.stderr[-2000:]
