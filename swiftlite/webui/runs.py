"""Training runs started from the Web-UI, and the runs list.

Everything a page shows about a run is on disk in the run folder, so reloading the page, a
second browser, or a restarted Web-UI all see the same thing:
  webui.json   command, pid, process start time, status, return code (written atomically)
  webui.log    the child's stdout and stderr
  logging.jsonl, checkpoint-*/  written by `swiftlite sft` itself
A run is `swiftlite sft ...` (as `python -m swiftlite.cli sft ...`) in its own process group, so
Stop can end it and any torchrun workers together. Starting is serialised with a lock file in the
output root, and refused while another run is alive: one run at a time per output root.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from swiftlite.errors import UsageError
from swiftlite.runtime.atomic import write_json
from swiftlite.runtime.output import RUN_DIR_ENV, claim_run_dir, is_complete

STATE_FILE, LOG_FILE = "webui.json", "webui.log"
AUTH_ENV = "SWIFTLITE_WEBUI_AUTH"  # the Web-UI's login (webui.app); never passed to runs
FINAL = ("finished", "failed", "stopped")
STOP_GRACE_S = 15  # SIGINT lets the Trainer unwind; then SIGTERM, then SIGKILL


@dataclass
class Run:
    path: str
    status: str  # running, stopping, finished, failed, stopped, incomplete (CLI run, no marker)
    started: float | None = None
    step: int | None = None
    max_steps: int | None = None
    loss: float | None = None
    checkpoints: list[str] = field(default_factory=list)
    command: str = ""

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


def read_state(run_dir: str) -> dict:
    try:
        with open(os.path.join(run_dir, STATE_FILE), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def write_state(run_dir: str, **updates) -> dict:
    """Update webui.json: under a lock on the run folder (the watcher, Stop and a second
    Web-UI may write at once; none loses another's update), replaced atomically (readers never
    see half a file)."""
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        state = {**read_state(run_dir), **updates}
        write_json(os.path.join(run_dir, STATE_FILE), state, indent=2)
    finally:
        os.close(fd)  # releases the lock
    return state


def _alive(state: dict) -> bool:
    """Is the recorded process still the one we started (not a recycled pid)?"""
    import psutil
    try:
        p = psutil.Process(state["pid"])
        return abs(p.create_time() - state["create_time"]) < 1 and p.status() != "zombie"
    except (KeyError, psutil.Error):
        return False


def status(run_dir: str) -> str:
    state = read_state(run_dir)
    if not state:  # a run started from the CLI
        return "finished" if os.path.exists(os.path.join(run_dir, "metrics.json")) \
            else "incomplete"
    from swiftlite.runtime.processes import from_records, running
    # the run's processes recorded when Stop was pressed (swiftlite, torchrun, workers)
    if state.get("stop_requested") and running(from_records(state.get("members", []))):
        return "stopping"  # stopped means every rank is gone
    if state.get("status") in FINAL:
        return state["status"]
    if _alive(state):
        return "stopping" if state.get("stop_requested") else "running"
    if state.get("status") == "starting" and time.time() - state.get("started", 0) < 30:
        return "running"  # between writing the state file and recording the pid
    # The process is gone and no watcher recorded its end (the Web-UI was restarted meanwhile).
    if state.get("stop_requested"):
        return "stopped"
    return "finished" if os.path.exists(os.path.join(run_dir, "metrics.json")) else "failed"


def loss_rows(run_dir: str) -> list[dict]:
    """The training-loss rows of logging.jsonl (a half-written last line is skipped)."""
    rows = []
    try:
        with open(os.path.join(run_dir, "logging.jsonl"), encoding="utf-8") as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                if "loss" in r:
                    rows.append(r)
    except OSError:
        pass
    return rows


def checkpoints(run_dir: str) -> list[str]:
    try:
        names = os.listdir(run_dir)
    except OSError:
        return []
    # a checkpoint still being written (or cut short) is not offered
    ckpts = [n for n in names if re.fullmatch(r"checkpoint-\d+-merged", n) or (
        re.fullmatch(r"checkpoint-\d+", n) and is_complete(os.path.join(run_dir, n)))]
    return sorted((os.path.join(run_dir, n) for n in ckpts),
                  key=lambda p: (int(re.search(r"(\d+)", os.path.basename(p)).group(1)), p))


def describe(run_dir: str) -> Run:
    state, rows = read_state(run_dir), loss_rows(run_dir)
    last = rows[-1] if rows else {}
    started = state.get("started")
    if started is None:
        try:
            started = os.path.getmtime(run_dir)
        except OSError:
            pass
    return Run(run_dir, status(run_dir), started, last.get("step"), last.get("max_steps"),
               last.get("loss"), checkpoints(run_dir), state.get("command_line", ""))


def find_runs(root: str, depth: int = 3) -> list[str]:
    """Run folders (v<N>-... with webui.json or args.json) under root, newest first."""
    found = []
    root = os.path.abspath(root)
    for dirpath, dirnames, filenames in os.walk(root):
        if re.match(r"v\d+-", os.path.basename(dirpath)) and (
                STATE_FILE in filenames or "args.json" in filenames):
            found.append(dirpath)
            dirnames[:] = []  # checkpoints are not runs
            continue
        if dirpath[len(root):].count(os.sep) >= depth:
            dirnames[:] = []
    return sorted(found, key=lambda p: os.path.getmtime(p), reverse=True)


# What a swiftlite child of the Web-UI (a run, a merge, an evaluation) takes from its
# environment: the system's (paths, locale, proxies), Python's, torchrun's (nodes, master
# address and port), the libraries' settings and caches (Hugging Face, torch, CUDA and the
# other accelerators, threads, DeepSpeed) and swiftlite's own. Everything else stays in the
# Web-UI: its login, and whatever the operator's shell holds (cloud keys, API tokens), which
# a model's remote code could otherwise read.
CHILD_ENV_NAMES = {
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "TMPDIR", "TEMP", "TMP", "LANG", "LANGUAGE",
    "TZ", "TERM", "PYTHONPATH", "PYTHONHOME", "PYTHONUNBUFFERED", "VIRTUAL_ENV", "CONDA_PREFIX",
    "LD_LIBRARY_PATH", "LD_PRELOAD", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME",
    "TOKENIZERS_PARALLELISM", "CC", "CXX", "MAX_JOBS", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY",
    "http_proxy", "https_proxy", "no_proxy", "SSL_CERT_FILE", "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"}  # training.launch.LAUNCH_VARS
CHILD_ENV_PREFIXES = (
    "LC_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "CUDA_", "NVIDIA_",
    "ROCR_", "HIP_", "ROCM_", "ASCEND_", "NCCL_", "GLOO_", "KMP_", "MKL_", "OMP_", "ONEDNN_",
    "DNNL_", "TCMALLOC_", "DS_", "DEEPSPEED_", "TRITON_", "BNB_", "SWIFTLITE_")


def child_environ() -> dict:
    """The Web-UI's environment as far as a swiftlite child needs it (CHILD_ENV_*), without
    the login and without any secret-named variable (HF_TOKEN too: the hub's login is read
    from its token file under HF_HOME)."""
    from swiftlite.config.secrets import is_secret
    return {k: v for k, v in os.environ.items()
            if (k in CHILD_ENV_NAMES or k.startswith(CHILD_ENV_PREFIXES)) and k != AUTH_ENV
            and not is_secret(k) and not k.upper().endswith(("_AUTH", "_CREDENTIALS"))}


def child_env(nproc: int, run_dir: str) -> dict:
    env = child_environ()  # the Web-UI's login is not the training run's business
    env[RUN_DIR_ENV] = run_dir  # the folder chosen here is the one sft writes (see runtime/output.py)
    env["PYTHONUNBUFFERED"] = "1"  # the log streams while training, not at exit
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if nproc > 1:
        env["NPROC_PER_NODE"] = str(nproc)
    else:
        env.pop("NPROC_PER_NODE", None)
    return env


class RunManager:
    """Starts and stops runs under one output root."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)
        self._lock_path = os.path.join(self.root, ".webui.lock")
        self._run_lock_path = os.path.join(self.root, ".webui-run.lock")

    def active(self) -> list[str]:
        return [r for r in find_runs(self.root) if status(r) in ("running", "stopping")]

    def start(self, argv: list[str], output_dir: str, nproc: int = 1,
              command_line: str = "", command: str = "sft") -> str:
        """Start `swiftlite COMMAND ARGV` (sft or rlhf) in a fresh run folder under
        output_dir; its path."""
        with open(self._lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two browsers pressing Start at once: one wins
            busy = self.active()
            if busy:
                raise UsageError(f"a run is already in progress ({os.path.relpath(busy[0], self.root)});"
                                 " wait for it to finish or stop it, then start again.")
            # The one-run lock itself is held by the run: its process inherits the locked file,
            # so the lock lasts exactly as long as the run, whatever webui.json says (a second
            # Web-UI, a deleted or corrupt state file cannot start a second run beside it).
            run_lock = open(self._run_lock_path, "a+")
            try:
                fcntl.flock(run_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                run_lock.seek(0)
                holder = run_lock.read().strip() or "?"
                run_lock.close()
                raise UsageError(f"a run started from a Web-UI is still in progress (pid "
                                 f"{holder}, holding {self._run_lock_path}); wait for it to "
                                 "finish or stop it, then start again.") from None
            run_dir = claim_run_dir(output_dir)
            if command not in ("sft", "rlhf"):
                raise UsageError(f"the Web-UI starts sft or rlhf runs, not {command!r}")
            cmd = [sys.executable, "-m", "swiftlite.cli", command, *argv]
            import shlex

            from swiftlite.config.secrets import redact_argv
            write_state(run_dir, status="starting", command=redact_argv(cmd),
                        command_line=shlex.join(redact_argv(shlex.split(command_line))),
                        nproc=nproc, started=time.time())
            log = open(os.path.join(run_dir, LOG_FILE), "ab")
            try:
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=child_env(nproc, run_dir),
                                        start_new_session=True,  # own process group for Stop
                                        pass_fds=(run_lock.fileno(),))
                run_lock.truncate(0)
                run_lock.write(str(proc.pid))
                run_lock.flush()
            finally:
                log.close()
                run_lock.close()  # the child keeps it locked
            import psutil
            write_state(run_dir, status="running", pid=proc.pid, pgid=proc.pid,
                        create_time=psutil.Process(proc.pid).create_time())
        threading.Thread(target=self._watch, args=(proc, run_dir), daemon=True).start()
        return run_dir

    @staticmethod
    def _watch(proc: subprocess.Popen, run_dir: str) -> None:
        rc = proc.wait()
        state = read_state(run_dir)
        final = "finished" if rc == 0 else "stopped" if state.get("stop_requested") else "failed"
        write_state(run_dir, status=final, returncode=rc, ended=time.time())

    def stop(self, run_dir: str) -> str:
        """End the run and every process it started (see runtime.processes); the run says
        "stopping" until the last of them is gone."""
        from swiftlite.runtime.processes import records, tree
        state = read_state(run_dir)
        if status(run_dir) != "running":
            raise UsageError(f"{os.path.basename(run_dir)} is not running "
                             f"({status(run_dir)}); nothing to stop.")
        members = tree(state["pid"], state.get("create_time"))
        write_state(run_dir, stop_requested=True, stop_time=time.time(),
                    members=records(members))
        threading.Thread(target=self._end, args=(run_dir, members), daemon=True).start()
        return "stopping"

    @staticmethod
    def _end(run_dir: str, members: list) -> None:
        from swiftlite.runtime.processes import end_tree, grow, records
        members = grow(members)  # any started since Stop was pressed count too
        write_state(run_dir, members=records(members))
        end_tree(members, ((signal.SIGINT, STOP_GRACE_S), (signal.SIGTERM, 5),
                           (signal.SIGKILL, 5)))
        if read_state(run_dir).get("status") not in FINAL:
            # No watcher in this process (the run was started by an earlier Web-UI).
            time.sleep(0.5)
            if read_state(run_dir).get("status") not in FINAL:
                write_state(run_dir, status="stopped", ended=time.time())
