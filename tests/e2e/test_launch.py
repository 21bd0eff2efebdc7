"""Launching: the torchrun command built from ms-swift-style env vars, its checks, and the
recipes in scripts/ (the command each builds; the 2-process runs themselves are in
test_deepspeed.py: torchrun, two nodes by env vars, the deepspeed launcher, NPROC_PER_NODE)."""
import os
import shlex
import stat
import subprocess
import sys

import pytest

from helpers.cli import REPO, run_cli

from swiftlite.errors import UsageError
from swiftlite.training.launch import torchrun_command, user_command

ARGV = ["sft", "--model", "tiny-qwen2"]


def flags(cmd) -> dict:
    return dict(a[2:].split("=", 1) for a in cmd if a.startswith("--") and "=" in a)


def test_one_process_needs_no_launcher():
    assert torchrun_command(ARGV, {}) is None
    assert torchrun_command(ARGV, {"NPROC_PER_NODE": "1"}) is None
    # A worker started by any launcher never relaunches itself.
    assert torchrun_command(ARGV, {"NPROC_PER_NODE": "2", "LOCAL_RANK": "0"}) is None


def test_nproc_per_node_relaunches_under_torchrun():
    cmd = torchrun_command(ARGV, {"NPROC_PER_NODE": "2", "MASTER_PORT": "29600"})
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert flags(cmd) == {"nproc_per_node": "2", "nnodes": "1", "master_port": "29600"}
    assert cmd[-5:] == ["-m", "swiftlite.cli"] + ARGV


def test_several_nodes():
    env = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29501",
           "NPROC_PER_NODE": "8"}
    assert flags(torchrun_command(ARGV, env)) == {
        "nproc_per_node": "8", "nnodes": "2", "node_rank": "1", "master_addr": "10.0.0.1",
        "master_port": "29501"}
    # Without NPROC_PER_NODE: one process per visible device, as ms-swift does.
    env = {"NNODES": "2", "NODE_RANK": "0", "CUDA_VISIBLE_DEVICES": "0,1,2"}
    assert flags(torchrun_command(ARGV, env))["nproc_per_node"] == "3"
    assert flags(torchrun_command(ARGV, env))["master_addr"] == "127.0.0.1"


@pytest.mark.parametrize("env, words", [
    ({"NPROC_PER_NODE": "two"}, ["NPROC_PER_NODE='two'", "whole number"]),
    ({"NPROC_PER_NODE": "0"}, ["at least 1"]),
    ({"NPROC_PER_NODE": "4", "CUDA_VISIBLE_DEVICES": "0,1"},
     ["NPROC_PER_NODE=4", "only 2 device(s)", "CUDA_VISIBLE_DEVICES=0,1"]),
    ({"NPROC_PER_NODE": "3", "ASCEND_RT_VISIBLE_DEVICES": "4,5"},
     ["ASCEND_RT_VISIBLE_DEVICES=4,5"]),
    ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "h"}, ["NODE_RANK=2 must be below NNODES=2"]),
    ({"NNODES": "2", "NODE_RANK": "1"}, ["set MASTER_ADDR"]),
])
def test_impossible_launch_settings_are_usage_errors(env, words):
    with pytest.raises(UsageError) as e:
        torchrun_command(ARGV, env)
    for word in words:
        assert word in str(e.value)


def test_user_command_keeps_the_launch_variables():
    env = {"CUDA_VISIBLE_DEVICES": "0,1", "NPROC_PER_NODE": "2", "HOME": "/root"}
    cmd = user_command(ARGV + ["--system", "Be brief."], env)
    assert cmd == ("NPROC_PER_NODE=2 CUDA_VISIBLE_DEVICES=0,1 swiftlite sft --model tiny-qwen2 "
                   "--system 'Be brief.'")


def test_cli_refuses_more_processes_than_devices(tmp_path):
    r = run_cli("sft", "--model", "tiny-qwen2", "--dataset", "self-cognition#4", "--output_dir",
                tmp_path, env={"NPROC_PER_NODE": "4", "CUDA_VISIBLE_DEVICES": "0"}, check=False)
    assert r.returncode == 2 and "only 1 device(s) are visible" in r.stderr, r.stderr
    assert not os.listdir(tmp_path)


# -- scripts/ ------------------------------------------------------------------------------------
def recipe(name, *args, **env) -> list[str]:
    """The command a recipe runs (DRY_RUN=1 prints it instead)."""
    full = {**os.environ, "DRY_RUN": "1", **{k: str(v) for k, v in env.items()}}
    for key in ("NPROC_PER_NODE", "NNODES", "NODE_RANK", "MASTER_ADDR", "CUDA_VISIBLE_DEVICES",
                "DS_ARGS", "DEEPSPEED"):
        if key not in env:
            full.pop(key, None)
    r = subprocess.run(["bash", os.path.join(REPO, "scripts", name), *args], env=full,
                       capture_output=True, text=True, check=True)
    return shlex.split(r.stdout)


def split_env(cmd):
    """`env A=1 B=2 prog ...` -> ({A: 1, B: 2}, [prog, ...])."""
    assert cmd[0] == "env"
    env, i = {}, 1
    while "=" in cmd[i] and not cmd[i].startswith("-"):
        k, v = cmd[i].split("=", 1)
        env[k], i = v, i + 1
    return env, cmd[i:]


def test_single_gpu_recipe():
    env, cmd = split_env(recipe("single_gpu.sh", "--max_steps", "5", MODEL="tiny-qwen2"))
    assert env == {"CUDA_VISIBLE_DEVICES": "0"}
    assert cmd[:3] == ["swiftlite", "sft", "--model"] and cmd[3] == "tiny-qwen2"
    assert cmd[-2:] == ["--max_steps", "5"] and torchrun_command(cmd[1:], env) is None


def test_multi_gpu_recipes():
    env, cmd = split_env(recipe("multi_gpu.sh", NPROC_PER_NODE=4, CUDA_VISIBLE_DEVICES="0,1,2,3"))
    assert env == {"NPROC_PER_NODE": "4", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert flags(torchrun_command(cmd[1:], env))["nproc_per_node"] == "4"
    assert cmd[cmd.index("--deepspeed") + 1] == "zero2"
    cmd = recipe("multi_gpu_torchrun.sh", NPROC_PER_NODE=8, DEEPSPEED="zero3")
    assert cmd[:5] == ["torchrun", "--nproc_per_node", "8", "--master_port", "29500"]
    assert cmd[5:9] == ["-m", "swiftlite.cli", "sft", "--model"] and "zero3" in cmd


@pytest.mark.parametrize("ds_args", ["--num_gpus 2", "--include localhost:1",
                                     "--hostfile scripts/hostfile"])
def test_deepspeed_launcher_recipe(ds_args):
    cmd = recipe("deepspeed_launcher.sh", "--max_steps", "3", DS_ARGS=ds_args)
    n = len(ds_args.split())
    assert cmd[0] == "deepspeed" and cmd[1:1 + n] == ds_args.split()
    assert cmd[1 + n:1 + n + 5] == ["--master_port", "29500", "--module", "swiftlite.cli", "sft"]
    assert cmd[-2:] == ["--max_steps", "3"]


def test_hostfile_lines_are_host_slots():
    lines = [line.split() for line in open(os.path.join(REPO, "scripts", "hostfile"))
             if line.strip() and not line.startswith("#")]
    assert lines and all(len(p) == 2 and p[1].startswith("slots=") and p[1][6:].isdigit()
                         for p in lines)


def test_two_nodes_recipe():
    for rank in (0, 1):
        env, cmd = split_env(recipe("two_nodes.sh", NODE_RANK=rank, MASTER_ADDR="10.0.0.1",
                                    NPROC_PER_NODE=2))
        assert flags(torchrun_command(cmd[1:], env)) == {
            "nproc_per_node": "2", "nnodes": "2", "node_rank": str(rank),
            "master_addr": "10.0.0.1", "master_port": "29500"}
    r = subprocess.run(["bash", os.path.join(REPO, "scripts", "two_nodes.sh")],
                       env={**os.environ, "DRY_RUN": "1", "NODE_RANK": "1"},
                       capture_output=True, text=True)
    assert r.returncode != 0 and "MASTER_ADDR" in r.stderr


def test_ascend_npu_recipe():
    env, cmd = split_env(recipe("ascend_npu.sh", ASCEND_RT_VISIBLE_DEVICES="0,1,2,3",
                                NPROC_PER_NODE=4))
    assert env == {"ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3", "NPROC_PER_NODE": "4"}
    assert flags(torchrun_command(cmd[1:], env))["nproc_per_node"] == "4"


def test_slurm_recipe_gives_each_node_its_rank(tmp_path):
    """SLURM cannot exist here: a stand-in `srun` starts the task once per node the way
    SLURM does (SLURM_NODEID set), and a stand-in `swiftlite` prints what it was given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {"srun": 'shift; for n in 0 1; do SLURM_NODEID=$n "$@"; done',
             "swiftlite": 'echo "NNODES=$NNODES NODE_RANK=$NODE_RANK MASTER_ADDR=$MASTER_ADDR '
                          'MASTER_PORT=$MASTER_PORT NPROC_PER_NODE=$NPROC_PER_NODE $*"',
             "scontrol": 'echo gpu-node-07; echo gpu-node-08'}
    for name, body in stubs.items():
        path = bin_dir / name
        path.write_text(f"#!/usr/bin/env bash\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "SLURM_JOB_NODELIST": "gpu-node-[07-08]", "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2",
           "SLURM_GPUS_ON_NODE": "4", "MODEL": "tiny-qwen2"}
    for key in ("MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE", "NODE_RANK", "NNODES"):
        env.pop(key, None)
    r = subprocess.run(["bash", os.path.join(REPO, "scripts", "slurm.sbatch"), "--max_steps", "9"],
                       env=env, capture_output=True, text=True, check=True)
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2
    for rank, line in enumerate(lines):
        words = line.split()
        env_vars = dict(w.split("=", 1) for w in words[:5])
        assert env_vars == {"NNODES": "2", "NODE_RANK": str(rank), "MASTER_ADDR": "gpu-node-07",
                            "MASTER_PORT": str(20000 + 4242), "NPROC_PER_NODE": "4"}
        assert words[5:8] == ["sft", "--model", "tiny-qwen2"] and words[-2:] == ["--max_steps",
                                                                                 "9"]
        assert flags(torchrun_command(words[5:], env_vars))["node_rank"] == str(rank)


def test_cli_ignores_the_local_rank_flag_of_the_deepspeed_launcher():
    """`deepspeed ... --module swiftlite.cli sft` runs `swiftlite.cli --local_rank=N sft ...`."""
    r = run_cli("--local_rank=1", "sft", "--help")
    assert "--deepspeed" in r.stdout
