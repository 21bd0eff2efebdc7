"""Nothing lost, nothing leaked: each test is named for the failure it prevents, and drives the
real CLI (child processes) the way a user or a crash would."""
import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from helpers.cli import copy_run, run_cli
from helpers.server import free_port

TINY = ["--model", "tiny-qwen2", "--max_steps", "2", "--per_device_train_batch_size", "2",
        "--gradient_accumulation_steps", "1", "--torch_dtype", "float32", "--report_to", "none"]


def sft_cmd(*args):
    return [sys.executable, "-m", "swiftlite.cli", "sft", *map(str, args)]


def _claim(root, q):
    from swiftlite.runtime.output import claim_run_dir
    q.put(claim_run_dir(root))


# -- run folders ------------------------------------------------------------------------------
def test_run_folders_claimed_at_once_never_collide(tmp_path):
    """Eight processes claiming a run folder under one output_dir at the same moment get eight
    folders with eight version numbers."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_claim, args=(str(tmp_path), q)) for _ in range(8)]
    for p in procs:
        p.start()
    got = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join()
    versions = [re.match(r"v(\d+)-", os.path.basename(g)).group(1) for g in got]
    assert len(set(got)) == 8 and sorted(map(int, versions)) == list(range(8))
    assert all(os.path.isdir(g) for g in got)


@pytest.mark.slow
def test_two_sft_started_together_keep_their_own_folders(tmp_path, chat_jsonl, tiny_qwen2):
    """A sweep with `&`: two runs, one output_dir; each has its own folder, args and
    checkpoints."""
    out = tmp_path / "out"
    procs = [subprocess.Popen(sft_cmd(*TINY, "--dataset", chat_jsonl, "--seed", seed,
                                      "--output_dir", out, "--save_total_limit", "1"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for seed in (1, 2)]
    for p in procs:
        assert p.wait(600) == 0, p.stderr.read()[-3000:]
    runs = sorted(os.listdir(out))
    assert len(runs) == 2, runs
    seeds = sorted(json.load(open(out / r / "args.json"))["seed"] for r in runs)
    assert seeds == [1, 2]
    assert all(os.listdir(out / r).count("checkpoint-2") == 1 for r in runs)


@pytest.mark.slow
def test_add_version_false_refuses_a_folder_holding_another_run(tiny_run, chat_jsonl):
    def listing():  # merge tests on the other worker may add *-merged folders meanwhile
        return sorted(d for d in os.listdir(tiny_run.output_dir) if "-merged" not in d)
    before = listing()
    r = run_cli("sft", *TINY, "--dataset", chat_jsonl, "--output_dir", tiny_run.output_dir,
                "--add_version", "false", check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "holds another run" in r.stderr and "--resume_from_checkpoint" in r.stderr
    assert listing() == before  # nothing touched


# -- checkpoints --------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_checkpoint_missing_a_file_is_refused_before_loading(tiny_run, chat_jsonl, tmp_path):
    """Resume checks the folder first (adapter, optimizer, scheduler, trainer state, RNG) and
    exits 2 naming what is missing; no run folder is made."""
    ckpt = tmp_path / "checkpoint-8"
    shutil.copytree(os.path.join(tiny_run.output_dir, "checkpoint-8"), ckpt)
    os.remove(ckpt / "optimizer.pt")
    out = tmp_path / "out"
    r = run_cli("sft", *TINY, "--dataset", chat_jsonl, "--output_dir", out,
                "--resume_from_checkpoint", ckpt, check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "optimizer.pt" in r.stderr
    assert not out.exists()


@pytest.mark.slow
def test_a_checkpoint_never_marked_complete_is_not_resumed(tiny_run, chat_jsonl, tmp_path):
    from swiftlite.runtime.output import COMPLETE_MARKER, last_checkpoint
    run = tmp_path / "run"
    copy_run(tiny_run.output_dir, run)
    os.remove(run / "checkpoint-8" / COMPLETE_MARKER)  # killed before it was marked
    assert last_checkpoint(str(run)) == str(run / "checkpoint-4")
    r = run_cli("sft", *TINY, "--dataset", chat_jsonl, "--output_dir", tmp_path / "out",
                "--resume_from_checkpoint", run / "checkpoint-8", check=False)
    assert r.returncode == 2 and "incomplete" in r.stderr and "checkpoint-4" in r.stderr


def _losses(run_dir) -> dict:
    out = {}
    with open(os.path.join(run_dir, "logging.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if "loss" in row and "step" in row:
                out[row["step"]] = row["loss"]
    return out


@pytest.mark.slow
def test_killed_while_saving_resumes_to_the_same_losses(tmp_path, chat_jsonl, tiny_qwen2):
    """SIGKILL the moment a checkpoint folder appears (its files still being written), then
    resume from the run folder: it continues from the last complete checkpoint, and every
    later step has the loss of an uninterrupted run."""
    args = ["--model", "tiny-qwen2", "--dataset", chat_jsonl + "#32", "--max_steps", "8",
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
            "--learning_rate", "1e-2", "--save_steps", "2", "--logging_steps", "1",
            "--torch_dtype", "float32", "--report_to", "none", "--lora_dropout", "0"]
    full = tmp_path / "full"
    run_cli("sft", *args, "--output_dir", full, "--add_version", "false")
    want = _losses(full)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(sft_cmd(*args, "--output_dir", killed, "--add_version", "false"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = killed / "checkpoint-6"
    deadline = time.time() + 600
    while not target.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert target.exists(), "the run ended before its third save"
    from swiftlite.runtime.output import is_complete
    assert not is_complete(target)  # killed while it was being written

    r = run_cli("sft", *args, "--output_dir", tmp_path / "resumed",
                "--resume_from_checkpoint", killed)
    assert "resuming from" in r.stderr
    (resumed,) = (tmp_path / "resumed").iterdir()
    got = _losses(resumed)
    assert got and min(got) >= 5  # continued after checkpoint-4 (or -6), not from step 0
    for step, loss in got.items():
        assert loss == pytest.approx(want[step], rel=1e-4, abs=1e-5), step


# -- secrets ----------------------------------------------------------------------------------
SECRET = "hf_sEcReT0123456789abcdef"


def _files_containing(root, needle: bytes) -> list[str]:
    hits = []
    for base, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(base, name), "rb") as f:
                if needle in f.read():
                    hits.append(os.path.join(base, name))
    return hits


@pytest.mark.slow
def test_tokens_are_never_written_to_disk_or_logs(tmp_path, chat_jsonl, tiny_qwen2):
    out = tmp_path / "out"
    r = run_cli("sft", *TINY, "--dataset", chat_jsonl, "--output_dir", out, "--hub_token",
                SECRET, "--save_steps", "2")
    assert SECRET not in r.stdout + r.stderr
    assert _files_containing(out, SECRET.encode()) == []
    (run,) = out.iterdir()
    saved = json.load(open(run / "args.json"))
    assert saved["hub_token"] == "<redacted>" and SECRET not in saved["command"]


def test_webui_keeps_its_login_and_tokens_from_runs(tmp_path, monkeypatch):
    """The Web-UI's auth variable is not passed to training runs, and webui.json records the
    command with its tokens redacted."""
    from swiftlite.webui.app import AUTH_ENV
    from swiftlite.webui.runs import child_env
    monkeypatch.setenv(AUTH_ENV, "admin:hunter2")
    assert AUTH_ENV not in child_env(1, str(tmp_path))
    from swiftlite.config.secrets import redact_argv
    assert redact_argv(["--hub_token", SECRET, "--api_key=k1", "--lr", "1"]) == [
        "--hub_token", "<redacted>", "--api_key=<redacted>", "--lr", "1"]


# -- merge-lora -----------------------------------------------------------------------------
def _merge_cmd(ckpt, out):
    return [sys.executable, "-m", "swiftlite.cli", "merge-lora", "--ckpt_dir", str(ckpt),
            "--output_dir", str(out)]


@pytest.mark.slow
def test_merge_killed_midway_leaves_nothing_and_two_merges_do_not_collide(tiny_run, tmp_path):
    ckpt = os.path.join(tiny_run.output_dir, "checkpoint-8")
    out = tmp_path / "merged"
    proc = subprocess.Popen(_merge_cmd(ckpt, out), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not any(p.name.startswith(".merged.tmp-") for p in tmp_path.iterdir()) and \
            proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    # Two merges into one folder at once: one writes it, the other is told why it cannot.
    procs = [subprocess.Popen(_merge_cmd(ckpt, out), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(300), p.stderr.read()) for p in procs]
    assert sorted(rc for rc, _ in results) == [0, 2], results
    (err,) = [e for rc, e in results if rc == 2]
    assert "Traceback" not in err and ("another swiftlite merge-lora" in err
                                       or "already exists" in err)
    assert (out / "config.json").exists()
    leftovers = [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    assert leftovers == []  # the killed merge's temp folder was swept


# -- stopping a multi-process run -------------------------------------------------------------
LONG_2PROC = ["--model", "tiny-qwen2", "--dataset", "self-cognition#64", "--max_steps", "100000",
              "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "1",
              "--save_steps", "100000", "--report_to", "none"]


def _two_rank_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (
        "SWIFTLITE_RUN_DIR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    return {**env, "NPROC_PER_NODE": "2", "MASTER_PORT": str(free_port()),
            "OMP_NUM_THREADS": "1"}


def _wait_for_training(pid: int, output_dir, timeout_s=240) -> list:
    """The run's processes once both ranks are training (a loss row is logged)."""
    from swiftlite.runtime.processes import tree
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        rows = [os.path.join(d, "logging.jsonl") for d, _, files in os.walk(output_dir)
                if "logging.jsonl" in files]
        members = tree(pid)
        if rows and os.path.getsize(rows[0]) and len(members) >= 4:  # sft, torchrun, 2 workers
            return members
        time.sleep(0.5)
    raise AssertionError(f"the 2-process run did not start training: {tree(pid)}")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill"])  # "ctrl-c" works too (13 s more; it passed before)
def test_stopping_swiftlite_ends_every_rank_of_a_multi_process_run(tmp_path, how):
    """Ctrl-C reaches the terminal's process group, not torchrun's workers (each in its own
    session); `kill PID` (a scheduler, a timeout) reaches swiftlite alone. Before: on SIGTERM
    swiftlite died at once and torchrun and both workers kept training; on Ctrl-C it
    SIGKILLed torchrun after 0.25 s, leaving the workers to end on their own."""
    from swiftlite.runtime.processes import running
    proc = subprocess.Popen(sft_cmd(*LONG_2PROC, "--output_dir", tmp_path / "out"),
                            env=_two_rank_env(), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        members = _wait_for_training(proc.pid, tmp_path / "out")
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)  # what the terminal does
        else:
            os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        assert running(members) == [], f"still running after Ctrl-C: {running(members)}"
        assert proc.returncode == 130 and re.search(r"stopping \d+ process\(es\) of the run", out), \
            out[-3000:]
    finally:
        from swiftlite.runtime.processes import end_tree, tree
        end_tree(tree(proc.pid), ((signal.SIGKILL, 5),))


@pytest.mark.slow
def test_web_ui_stop_ends_every_rank_and_a_corrupt_state_cannot_start_a_second_run(tmp_path):
    """Stop in the Web-UI says "stopped" only once every rank is gone (before: the workers kept
    running while the UI said stopped and allowed a new Start). While the run lives, the
    one-run lock is held by the run itself, so a damaged webui.json does not open it."""
    from swiftlite.errors import UsageError
    from swiftlite.runtime.processes import running
    from swiftlite.webui.runs import STATE_FILE, RunManager, status
    root = tmp_path / "out"
    manager = RunManager(str(root))
    env = _two_rank_env()
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        run_dir = manager.start(LONG_2PROC, str(root / "tiny-qwen2"), nproc=2)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    state_file = os.path.join(run_dir, STATE_FILE)
    pid = json.load(open(state_file))["pid"]
    try:
        members = _wait_for_training(pid, run_dir)
        good = open(state_file).read()
        open(state_file, "w").write("{not json")
        with pytest.raises(UsageError, match="still in progress"):
            RunManager(str(root)).start(LONG_2PROC, str(root / "tiny-qwen2"))
        open(state_file, "w").write(good)
        manager.stop(run_dir)
        deadline = time.time() + 90
        while time.time() < deadline and status(run_dir) != "stopped":
            time.sleep(0.2)
        assert status(run_dir) == "stopped"
        assert running(members) == [], f"'stopped' while these run: {running(members)}"
    finally:
        from swiftlite.runtime.processes import end_tree, tree
        end_tree(tree(pid), ((signal.SIGKILL, 5),))


# -- the encoding cache -----------------------------------------------------------------------
ENCODE_ONE = """
import json, sys
from swiftlite.data import load_conversations
from swiftlite.data.encode import encode_dataset
from swiftlite.data.template import get_template
from swiftlite.models.loader import load_tokenizer
convs, _ = load_conversations(["self-cognition#3000"])
template = get_template("qwen", load_tokenizer(sys.argv[1]))
print("ready", flush=True)
sys.stdin.readline()  # start together
ds, report = encode_dataset(convs, template, max_length=256)
print(json.dumps({"from_cache": report.from_cache, "rows": len(ds)}), flush=True)
"""


@pytest.mark.slow
def test_ranks_on_a_cold_cache_encode_once_and_never_race(tmp_path, tiny_qwen2):
    """Three processes (the ranks of a node) on a cold cache: one encodes, the others wait and
    memory-map its result; what killed encoders left is swept. Before: every process encoded,
    and the rmtree + rename of the cache folder raced (FileNotFoundError / ENOTEMPTY)."""
    from swiftlite.data import load_conversations
    from swiftlite.data.encode import cache_key
    from swiftlite.data.template import get_template
    from swiftlite.models.loader import load_tokenizer
    cache = tmp_path / "cache"
    env = {**os.environ, "SWIFTLITE_CACHE": str(cache)}
    convs, _ = load_conversations(["self-cognition#3000"])
    key = cache_key(convs, get_template("qwen", load_tokenizer(tiny_qwen2)), 256, "delete")
    datasets_dir = cache / "datasets"
    killed = [datasets_dir / f".train-{key}.tmp-4242", datasets_dir / ".train-k1ll3d00"]
    for k in killed:
        k.mkdir(parents=True)
        (k / "data-00000-of-00001.arrow").write_bytes(b"\0" * 1000)
    os.utime(killed[1], (time.time() - 2 * 86400,) * 2)  # the old naming: swept after a day
    procs = [subprocess.Popen([sys.executable, "-c", ENCODE_ONE, tiny_qwen2], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()[-3000:]
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["from_cache"] for r in results) == [False, True, True], results
    assert len({r["rows"] for r in results}) == 1
    assert not any(k.exists() for k in killed)
    assert [n for n in os.listdir(datasets_dir) if not n.endswith(".lock")] == [f"train-{key}"]
