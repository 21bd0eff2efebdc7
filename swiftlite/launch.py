"""Start more processes with torchrun when asked through ms-swift-style environment
variables: NPROC_PER_NODE, NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT.

`NPROC_PER_NODE=2 swiftlite sft ...` re-runs the same command under torchrun. The parent
picks the run folder once (SWIFTLITE_RUN_DIR) so every rank writes into the same one.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys

from .errors import RunError
from .log import info
from .output import RUN_DIR_ENV, planned_run_dir


def torchrun_command(argv: list[str], env: dict) -> list[str] | None:
    """The torchrun command for these env vars, or None when one process is enough."""
    nproc = int(env.get("NPROC_PER_NODE", "1") or 1)
    nnodes = int(env.get("NNODES", "1") or 1)
    if (nproc <= 1 and nnodes <= 1) or "LOCAL_RANK" in env:
        return None
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--nnodes={nnodes}"]
    if nnodes > 1 or "MASTER_ADDR" in env:
        cmd += [f"--node_rank={env.get('NODE_RANK', '0')}",
                f"--master_addr={env.get('MASTER_ADDR', '127.0.0.1')}",
                f"--master_port={env.get('MASTER_PORT', '29500')}"]
    else:
        cmd += [f"--master_port={env.get('MASTER_PORT', '29500')}"]
    return cmd + ["-m", "swiftlite.cli"] + argv


def maybe_relaunch(args) -> None:
    """Re-run this command under torchrun if the environment asks for more processes."""
    cmd = torchrun_command(["sft"] + sys.argv[2:], os.environ)
    if cmd is None:
        return
    env = dict(os.environ)
    env.setdefault(RUN_DIR_ENV, planned_run_dir(args))
    # torchrun sets OMP_NUM_THREADS=1 unless told otherwise: keep all cores shared out.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) //
                                              int(env.get("NPROC_PER_NODE", "1")))))
    info("launching: " + shlex.join(cmd))
    rc = subprocess.call(cmd, env=env)
    if rc != 0:
        raise RunError(f"the distributed run failed (exit code {rc}); see the log above.")
    sys.exit(0)

