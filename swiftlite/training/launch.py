"""Start more processes with torchrun when asked through ms-swift-style environment
variables: NPROC_PER_NODE, NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT (devices are chosen
with CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES, which the workers inherit).

`NPROC_PER_NODE=2 swiftlite sft ...` re-runs the same command under torchrun. The parent
picks the run folder once (SWIFTLITE_RUN_DIR) so every rank writes into the same one. When
the user starts the ranks themselves (`torchrun -m swiftlite.cli sft ...`, the `deepspeed`
launcher, SLURM, several nodes), rank 0 picks the folder and sends it to the others.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys

from swiftlite.errors import RunError, UsageError
from swiftlite.log import info
from swiftlite.runtime.output import RUN_DIR_ENV, claim_run_dir, other_run_files

COMMAND_ENV = "SWIFTLITE_COMMAND"  # the user's command line, saved in args.json by rank 0
LAUNCH_VARS = ("NPROC_PER_NODE", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
               "CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES")


def _int_env(env: dict, name: str, default: int, minimum: int) -> int:
    raw = env.get(name, "")
    try:
        value = int(raw) if str(raw).strip() else default
    except ValueError:
        raise UsageError(f"{name}={raw!r}: expected a whole number.") from None
    if value < minimum:
        raise UsageError(f"{name}={raw}: must be at least {minimum}.")
    return value


def visible_devices(env: dict) -> list[str] | None:
    """Device ids named by CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES (None: unset)."""
    for name in ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES"):
        if name in env:
            return [d for d in env[name].replace(" ", "").split(",") if d]
    return None


def torchrun_command(argv: list[str], env: dict) -> list[str] | None:
    """The torchrun command for these env vars, or None when one process is enough.

    Raises UsageError for values that cannot work (so no worker starts in vain)."""
    if "LOCAL_RANK" in env:  # already a worker
        return None
    nnodes = _int_env(env, "NNODES", 1, 1)
    devices = visible_devices(env)
    # Several nodes without NPROC_PER_NODE: one process per visible device (ms-swift does so).
    default_nproc = len(devices) if nnodes > 1 and devices else 1
    nproc = _int_env(env, "NPROC_PER_NODE", default_nproc, 1)
    if nproc <= 1 and nnodes <= 1:
        return None
    if devices is not None and nproc > len(devices):
        raise UsageError(f"NPROC_PER_NODE={nproc} but only {len(devices)} device(s) are visible "
                         f"({'CUDA' if 'CUDA_VISIBLE_DEVICES' in env else 'ASCEND_RT'}"
                         f"_VISIBLE_DEVICES={','.join(devices)}); list more devices or start "
                         "fewer processes.")
    node_rank = _int_env(env, "NODE_RANK", 0, 0)
    if node_rank >= nnodes:
        raise UsageError(f"NODE_RANK={node_rank} must be below NNODES={nnodes}.")
    if nnodes > 1 and node_rank > 0 and not env.get("MASTER_ADDR"):
        raise UsageError(f"NNODES={nnodes}, NODE_RANK={node_rank}: set MASTER_ADDR to the "
                         "address of the node with NODE_RANK=0.")
    port = _int_env(env, "MASTER_PORT", 29500, 1)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--nnodes={nnodes}"]
    if nnodes > 1 or env.get("MASTER_ADDR"):
        cmd += [f"--node_rank={node_rank}",
                f"--master_addr={env.get('MASTER_ADDR') or '127.0.0.1'}"]
    return cmd + [f"--master_port={port}", "-m", "swiftlite.cli"] + argv


def _nproc(cmd: list[str]) -> int:
    return int(next(a for a in cmd if a.startswith("--nproc_per_node=")).split("=")[1])


def user_command(argv: list[str], env: dict) -> str:
    """The command as the user ran it, with the launch variables that shaped it."""
    from swiftlite.config.secrets import redact_argv
    prefix = [f"{k}={shlex.quote(env[k])}" for k in LAUNCH_VARS if k in env]
    return " ".join(prefix + ["swiftlite", shlex.join(redact_argv(argv))])


def output_root(args) -> str:
    from swiftlite.models.registry import model_name
    return args.output_dir or os.path.join("output", model_name(args.model))


def check_output_dir(args) -> None:
    """--add_version false writes into --output_dir itself: refuse one that holds another run
    (its args would be overwritten, its checkpoints mixed with this run's and rotated away)."""
    root = output_root(args)
    if args.add_version or os.environ.get(RUN_DIR_ENV):
        return
    files = other_run_files(root)
    if files:
        raise UsageError(
            f"--output_dir {root} holds another run ({', '.join(files[:4])}"
            f"{', ...' if len(files) > 4 else ''}) and --add_version false would write this "
            "run over it. Pick a new --output_dir, drop --add_version false (each run then gets "
            "its own v<N>-<timestamp> folder), or continue that run with "
            f"--resume_from_checkpoint {root} (into a new folder).")


def claim_run_dir_for(args) -> str:
    """The run folder for these arguments, created now (atomically: see runtime.output)."""
    if os.environ.get(RUN_DIR_ENV):
        return os.path.abspath(os.environ[RUN_DIR_ENV])
    root = output_root(args)
    if args.add_version:
        return os.path.abspath(claim_run_dir(root))
    check_output_dir(args)
    os.makedirs(root, exist_ok=True)
    return os.path.abspath(root)


def maybe_relaunch(args, command: str = "sft") -> None:
    """Re-run this command under torchrun if the environment asks for more processes;
    in a worker started by any launcher, make all ranks agree on the run folder."""
    argv = [command] + sys.argv[2:]
    if "LOCAL_RANK" in os.environ:  # a worker: the sft pipeline agrees on the run folder
        return
    os.environ[COMMAND_ENV] = user_command(argv, os.environ)
    info("command: " + os.environ[COMMAND_ENV])
    cmd = torchrun_command(argv, os.environ)
    if args.deepspeed and str(args.deepspeed).strip() != "auto":
        from swiftlite.training.deepspeed import load_config
        load_config(args.deepspeed)  # a bad preset/JSON fails here, not in every worker later
    if args.deepspeed and args.resume_from_checkpoint:
        # Refuse a ZeRO resume with another process count before any worker starts.
        from swiftlite.training.deepspeed import check_resume
        check_resume(args.resume_from_checkpoint,
                     (_nproc(cmd) if cmd else 1) * int(os.environ.get("NNODES") or 1))
    if cmd is None:
        return
    env = dict(os.environ)
    nnodes = int(env.get("NNODES", "1") or 1)
    if nnodes == 1:
        # One node: the parent picks the folder. Several nodes: each node has its own
        # parent, so global rank 0 picks it (agree_run_dir) and tells the others.
        if RUN_DIR_ENV not in env:
            env[RUN_DIR_ENV] = claim_run_dir_for(args)
    # torchrun sets OMP_NUM_THREADS=1 unless told otherwise: keep all cores shared out.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _nproc(cmd))))
    from swiftlite.config.secrets import redact_argv
    info("launching: " + shlex.join(redact_argv(cmd)))
    rc = _run_to_the_end(cmd, env)
    if nnodes == 1:
        from swiftlite.runtime.output import remove_if_empty
        remove_if_empty(env[RUN_DIR_ENV])
    if rc != 0:
        raise RunError(f"the distributed run failed (exit code {rc}); see the log above.")
    sys.exit(0)


class _Stopped(Exception):
    pass


def _run_to_the_end(cmd: list[str], env: dict) -> int:
    """Run torchrun and wait for it; on Ctrl-C or SIGTERM, end it and every worker (which
    torchrun starts in sessions of their own, out of reach of the terminal's signal) before
    returning. subprocess.call would SIGKILL torchrun 0.25 s after a Ctrl-C and leave the
    workers running."""
    import signal

    from swiftlite.runtime.processes import end_tree, tree

    def on_term(signum, frame):
        raise _Stopped()

    proc = subprocess.Popen(cmd, env=env)
    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        return proc.wait()
    except (KeyboardInterrupt, _Stopped):
        members = tree(proc.pid)
        info(f"stopping {len(members)} process(es) of the run (torchrun and its workers)...")
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut this short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        end_tree(members)
        proc.wait()
        raise KeyboardInterrupt from None
    finally:
        if signal.getsignal(signal.SIGTERM) is on_term:
            signal.signal(signal.SIGTERM, previous)


def agree_run_dir(args) -> str:
    """The run folder, the same on every rank. In a multi-process run without
    SWIFTLITE_RUN_DIR (started by torchrun, deepspeed, SLURM, or over several nodes), rank 0
    picks it and sends it to the others through the launcher's rendezvous store, so the ranks
    never split into two vN-timestamp folders.

    The store is torch's own env:// rendezvous (torchrun's agent store, or a multi-tenant
    TCPStore hosted by rank 0 that init_process_group later shares); no process group is
    created, so accelerate still sets up the real backend (nccl/hccl/gloo) as usual. Nothing
    is left in os.environ: a second run in the same processes gets a folder of its own."""
    if os.environ.get(RUN_DIR_ENV) or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return claim_run_dir_for(args)
    global _STORE, _RUNS
    from datetime import timedelta

    import torch.distributed as dist
    store, rank, _ = next(dist.rendezvous("env://", timeout=timedelta(minutes=30)))
    _STORE = store  # rank 0 may host the server: keep it alive for init_process_group
    key, _RUNS = f"swiftlite/run_dir/{_RUNS}", _RUNS + 1  # every rank runs the same sequence
    if rank == 0:
        store.set(key, claim_run_dir_for(args))
    return store.get(key).decode()  # waits for rank 0


_STORE, _RUNS = None, 0
