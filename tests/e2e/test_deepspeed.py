"""DeepSpeed presets and real ZeRO runs: 2 processes with gloo on this CPU, tiny-qwen2.

Every 2-process run costs start-up time (imports, DeepSpeed init), so each one is shared by
several tests through a module-scoped fixture, and each goes through a different launcher:
plain torchrun (ZeRO-0), two "nodes" by env vars (ZeRO-1), the `deepspeed` launcher (ZeRO-2),
torchrun with a weight-capturing callback (ZeRO-3), NPROC_PER_NODE (offload, full FT, resume).
"""
import json
import os
import socket
import subprocess
import sys

import pytest

from helpers.cli import REPO, run_cli

from swiftlite.training import deepspeed as ds
from swiftlite.errors import UsageError

BIN = os.path.dirname(sys.executable)
# Same global batch (4) in every run: 1 process x 4, or 2 processes x 2. No dropout, so the
# single-process run and the 2-process runs compute the same thing.
TRAIN = ["--model", "tiny-qwen2", "--dataset", "self-cognition#32", "--max_steps", "4",
         "--gradient_accumulation_steps", "1", "--logging_steps", "1", "--lora_dropout", "0",
         "--learning_rate", "5e-3", "--report_to", "none",
         "--torch_dtype", "float32"]  # as DeepSpeed on a CPU: the same sums as the ranks
TOL = 1e-4  # measured differences are ~2e-6 (float summation order across ranks)


# -- presets and config loading (fast) ---------------------------------------------------------
def test_presets_are_shipped_and_leave_values_to_the_trainer():
    names = ds.preset_names()
    assert names == sorted(["zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"])
    for name in names:
        config = ds.load_config(name)
        assert ds.zero_stage(config) == int(name[4])
        for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                    "gradient_clipping", "train_batch_size"):
            assert config[key] == "auto", (name, key)
        assert config["bf16"]["enabled"] == config["fp16"]["enabled"] == "auto"
        if name.endswith("offload"):
            assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
            assert set(config["optimizer"]["params"].values()) == {"auto"}
        if name.startswith("zero3"):
            assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"]
    assert "offload_param" in ds.load_config("zero3_offload")["zero_optimization"]


def test_config_from_file_inline_json_and_dict(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_batch_size": "auto"}))
    assert ds.zero_stage(ds.load_config(str(path))) == 2
    assert ds.zero_stage(ds.load_config('{"zero_optimization": {"stage": 3}}')) == 3
    given = {"zero_optimization": {"stage": 1}}
    loaded = ds.load_config(given)
    loaded["zero_optimization"]["stage"] = 0
    assert given["zero_optimization"]["stage"] == 1  # the caller's dict is never filled in
    # The batch sizes, accumulation and clipping are the Trainer's: a config that leaves them
    # out gets them as "auto" (DeepSpeed stopped after the model had loaded without a batch
    # size), one that sets them keeps its values.
    inline = ds.load_config('{"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5}')
    assert {k: inline[k] for k in ds.TRAINER_KEYS} == {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto", "gradient_clipping": 0.5}
    assert ds.load_config(str(path))["train_batch_size"] == "auto"


@pytest.mark.parametrize("value, words", [
    ("zero4", ["not a preset and no such file", "zero2_offload", "zero3"]),
    ('{"zero_optimization": {"stage": 2}', ["malformed JSON", "line 1", "zero0"]),
    ("[1, 2]", ["not a preset"]),
    ('{"zero_optimization": {"stage": 5}}', ["stage must be 0, 1, 2 or 3"]),
])
def test_bad_deepspeed_values_name_the_presets(value, words):
    with pytest.raises(UsageError) as e:
        ds.load_config(value)
    for word in words:
        assert word in str(e.value), str(e.value)


def test_malformed_json_file_names_the_file_and_line(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{\n  "zero_optimization": {"stage": 2,}\n}\n')
    with pytest.raises(UsageError, match=r"broken.json: malformed JSON at line 2"):
        ds.load_config(str(path))


def test_sft_help_lists_presets_and_bad_preset_is_a_usage_error(tmp_path):
    out = run_cli("sft", "--help").stdout
    for name in ds.preset_names():
        assert name in out
    r = run_cli("sft", "--model", "tiny-qwen2", "--dataset", "self-cognition#4",
                "--deepspeed", "zero9", "--output_dir", tmp_path, check=False)
    assert r.returncode == 2 and "zero9: not a preset" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not os.listdir(tmp_path)


@pytest.mark.parametrize("device, model, train_type, device_gib, host_gib", [
    ("cpu", "tiny-qwen2", "lora", None, None),
    # CUDA cannot exist here: the card's memory is mocked (2 per node), and for the offload
    # case the host's RAM too (a GPU server's 256 GiB).
    ("cuda", "Qwen2-1.5B-Instruct", "lora", 12, None),
    ("cuda", "Qwen2-1.5B-Instruct", "full", 12, None),
    ("cuda", "Qwen2-1.5B-Instruct", "full", 16, 256),
])
def test_deepspeed_auto_takes_the_estimate_recommendation(device, model, train_type, device_gib,
                                                          host_gib, tiny_qwen2, monkeypatch,
                                                          capsys):
    """The same choice as `swiftlite estimate` for the devices present, decided and said once
    per run (setup resolves --deepspeed twice), in terms of the device: a CPU process's share
    of host memory is not a GPU."""
    import psutil
    from swiftlite.config.arguments import SftArguments
    from swiftlite.runtime.hardware import Hardware
    from swiftlite.pipelines.estimate import recommend
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    if host_gib:
        real = psutil.virtual_memory
        monkeypatch.setattr(psutil, "virtual_memory",
                            lambda: real()._replace(total=host_gib * 2**30))
    ram = psutil.virtual_memory().total
    memory = device_gib * 2**30 if device_gib else ram // 2
    monkeypatch.setattr(ds, "_device_memory", lambda hw: device_gib and memory)
    hw = Hardware(device, "test", (8, 6) if device == "cuda" else None)
    dtype = "bfloat16" if device == "cuda" else "float32"
    args = SftArguments(model=model, dataset=["x"], deepspeed="auto", train_type=train_type)
    choice = recommend(model, gpus=2, nodes=1, gpu_memory=memory, cpu_memory=ram,
                       train_type=train_type, torch_dtype=dtype)
    if not choice.fits:  # e.g. full FT needs offload, and this host's RAM is too small for it
        with pytest.raises(UsageError, match="--deepspeed auto: no configuration fits"):
            ds.resolve(args, hw)
        return
    got = ds.resolve(args, hw)
    assert (got is None) if choice.deepspeed is None else got == ds.load_config(choice.deepspeed)
    assert ds.resolve(args, hw) == got
    said = [line for line in capsys.readouterr().err.splitlines() if "--deepspeed auto:" in line]
    assert len(said) == 1, said
    assert ("per GPU" in said[0]) == (device == "cuda")
    assert ("host memory per process" in said[0]) == (device == "cpu")


# -- real 2-process runs -----------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra) -> dict:
    env = {**os.environ,  # PATH starts with the venv's bin (conftest.py)
           "MODEL": "tiny-qwen2", "DATASET": "self-cognition#32", "OMP_NUM_THREADS": "1"}
    for key in ("NPROC_PER_NODE", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                "SWIFTLITE_RUN_DIR", "SWIFTLITE_COMMAND", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                "TENSORBOARD_LOGGING_DIR", "ACCELERATE_USE_DEEPSPEED"):
        env.pop(key, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(cmd, env, timeout=600):
    r = subprocess.run([str(c) for c in cmd], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, f"{cmd} exited {r.returncode}\n{r.stderr[-6000:]}"
    return r


def the_run_dir(output_dir) -> str:
    """The one run folder under output_dir (all ranks must have agreed on it)."""
    runs = sorted(d for d in os.listdir(output_dir) if d.startswith("v"))
    assert len(runs) == 1, runs
    return os.path.join(output_dir, runs[0])


def losses(run_dir) -> list[tuple[int, float, float]]:
    with open(os.path.join(run_dir, "logging.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    # grad_norm: DeepSpeed reports none under ZeRO-0
    return [(r["step"], r["loss"], r.get("grad_norm")) for r in rows if "loss" in r]


def assert_same_losses(got, want, tol=TOL):
    assert [s for s, _, _ in got] == [s for s, _, _ in want]
    for (step, loss, gnorm), (_, loss0, gnorm0) in zip(got, want):
        assert abs(loss - loss0) <= tol * max(1.0, abs(loss0)), (step, loss, loss0)
        if gnorm is not None:
            assert abs(gnorm - gnorm0) <= tol * max(1.0, abs(gnorm0)), (step, gnorm, gnorm0)


@pytest.fixture(scope="module")
def single(tiny_qwen2, tmp_path_factory):
    """The reference: one process, no DeepSpeed, batch 4 (in this process: no start-up cost)."""
    import swiftlite
    from swiftlite.config.arguments import SftArguments
    from swiftlite.config.argv import parse_argv
    out = tmp_path_factory.mktemp("single")
    args = parse_argv(SftArguments, TRAIN + ["--per_device_train_batch_size", "4",
                                                 "--save_steps", "100", "--output_dir", str(out)],
                      "test", "")
    return losses(swiftlite.sft(args).output_dir)


@pytest.fixture(scope="module")
def zero3_run(tiny_qwen2, tmp_path_factory):
    """ZeRO-3 LoRA under plain torchrun; checkpoints at 2 and 4, in-memory adapters captured."""
    out, capture = tmp_path_factory.mktemp("zero3"), tmp_path_factory.mktemp("capture")
    run([os.path.join(BIN, "torchrun"), "--nproc_per_node", 2, "--master_port", free_port(),
         os.path.join(REPO, "tests", "helpers", "zero3_capture.py"), capture, "sft", *TRAIN,
         "--per_device_train_batch_size", "2", "--save_steps", "2", "--deepspeed", "zero3",
         "--output_dir", out], child_env())
    return the_run_dir(out), str(capture)


@pytest.mark.slow
def test_zero0_plain_torchrun_matches_single_process(single, tmp_path):
    """Also: on a cold data cache, one rank tokenises and the other never runs the encoder
    (it waits for the entry and memory-maps it)."""
    from swiftlite.runtime.paths import cache_dir
    cold = tmp_path / "cache"
    cold.mkdir()
    os.symlink(cache_dir("models"), cold / "models")  # the built models, not the data cache
    r = run(["bash", "scripts/multi_gpu_torchrun.sh", "--per_device_train_batch_size", "2",
             "--save_steps", "100", *TRAIN[4:]],
            child_env(DEEPSPEED="zero0", NPROC_PER_NODE=2, MASTER_PORT=free_port(),
                      OUTPUT_DIR=tmp_path / "out", SWIFTLITE_CACHE=cold,
                      SWIFTLITE_LOG_ALL_RANKS=1))
    assert_same_losses(losses(the_run_dir(tmp_path / "out")), single)
    encoded = [line for line in r.stderr.splitlines() if "train: tokenised 32 samples" in line]
    mapped = [line for line in r.stderr.splitlines()
              if "train: tokenised data loaded from the cache" in line]
    assert len(encoded) == 1 and len(mapped) == 1, r.stderr[-4000:]
    assert {encoded[0].split("]")[0], mapped[0].split("]")[0]} == {
        "[swiftlite rank 0", "[swiftlite rank 1"}


@pytest.mark.slow
def test_zero1_two_nodes_by_env_vars_train_together(single, tmp_path):
    """NNODES=2 on one machine: two commands (node ranks 0 and 1), one process each."""
    port = free_port()
    procs = [subprocess.Popen(["bash", "scripts/two_nodes.sh", "--per_device_train_batch_size",
                               "2", "--save_steps", "100", *TRAIN[4:]], cwd=REPO,
                              env=child_env(NODE_RANK=rank, MASTER_ADDR="127.0.0.1",
                                            MASTER_PORT=port, NPROC_PER_NODE=1,
                                            DEEPSPEED="zero1", OUTPUT_DIR=tmp_path),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-6000:]
    run_dir = the_run_dir(tmp_path)
    assert_same_losses(losses(run_dir), single)
    command = json.load(open(os.path.join(run_dir, "args.json")))["command"]
    assert command.startswith("NPROC_PER_NODE=1 NNODES=2 NODE_RANK=0 MASTER_ADDR=127.0.0.1 ")
    assert "--deepspeed zero1" in command


@pytest.mark.slow
def test_zero2_deepspeed_launcher_matches_single_process(single, tmp_path):
    """Also: no rank builds or loads DeepSpeed's shared-memory all-reduce (a C++ op that only
    its inference all-reduce uses, compiled for a minute on a machine's first DeepSpeed run),
    so none leaves its 67 MB buffer in /dev/shm, as its launcher's ranks did."""
    import glob
    port = free_port()
    extensions = tmp_path / "torch_extensions"  # where a build would go: empty at the start
    run(["bash", "scripts/deepspeed_launcher.sh", "--per_device_train_batch_size", "2",
         "--save_steps", "100", *TRAIN[4:]],
        child_env(DEEPSPEED="zero2", DS_ARGS="--num_gpus 2", MASTER_PORT=port,
                  OUTPUT_DIR=tmp_path / "out", TORCH_EXTENSIONS_DIR=extensions))
    assert_same_losses(losses(the_run_dir(tmp_path / "out")), single)
    assert not glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*")
    assert not (extensions.exists() and os.listdir(extensions)), os.listdir(extensions)


@pytest.mark.slow
def test_zero3_matches_single_process(zero3_run, single):
    assert_same_losses(losses(zero3_run[0]), single)


# The LoRA variants ZeRO-3 takes (DoRA and PiSSA/OLoRA are refused: test_lora_variants.py), and
# --modules_to_save lm_head (tied to the embeddings in tiny-qwen2): trained whole, not a partition
ZERO3_VARIANTS = ["--use_rslora", "true", "--lora_plus_lr_ratio", "4", "--lora_bias", "true",
                  "--target_modules", r".*\.(q|v|down)_proj", "--modules_to_save", "lm_head"]


@pytest.mark.slow
def test_zero3_with_lora_variants_matches_single_process(tiny_qwen2, tmp_path):
    """rsLoRA, LoRA+, lora_bias, a regex of target modules and --modules_to_save lm_head under
    ZeRO-3 on two processes: the losses of one process with the same flags, and an adapter (its
    biases, the whole trained head) that plain peft loads."""
    import swiftlite
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from swiftlite.config.arguments import SftArguments
    from swiftlite.config.argv import parse_argv
    flags = TRAIN + ZERO3_VARIANTS + ["--save_steps", "4"]
    one = swiftlite.sft(parse_argv(SftArguments, flags + [
        "--per_device_train_batch_size", "4", "--output_dir", str(tmp_path / "one")], "test", ""))
    run([os.path.join(BIN, "torchrun"), "--nproc_per_node", 2, "--master_port", free_port(),
         "-m", "swiftlite.cli", "sft", *flags, "--per_device_train_batch_size", "2",
         "--deepspeed", "zero3", "--output_dir", tmp_path / "zero3"], child_env())
    run_dir = the_run_dir(tmp_path / "zero3")
    assert_same_losses(losses(run_dir), losses(one.output_dir))
    ckpt = os.path.join(run_dir, "checkpoint-4")
    saved = load_file(os.path.join(ckpt, "adapter_model.safetensors"))
    lora = {k: t for k, t in saved.items() if "lora_" in k}
    assert len(lora) == 3 * 3 * 2 and all(t.numel() for t in saved.values())  # A, B, bias
    assert sorted({k.split(".")[-3] for k in lora}) == ["down_proj", "q_proj", "v_proj"]
    whole = [t for k, t in saved.items() if "lora_" not in k]
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    assert whole and all(t.shape == base.lm_head.weight.shape for t in whole), {
        k: t.shape for k, t in saved.items()}
    config = json.load(open(os.path.join(ckpt, "adapter_config.json")))
    assert config["use_rslora"] is True and config["lora_bias"] is True
    PeftModel.from_pretrained(base, ckpt)


@pytest.mark.slow
def test_python_api_under_torchrun_ends_the_group_it_started_at_exit(zero3_run):
    """swiftlite.sft in a torchrun rank leaves the process group the run started for later
    runs, and the exit handlers end it: a rank that reaches the interpreter's teardown with a
    gloo group alive can abort after a finished run ("terminate called without an active
    exception", exit -6: this fixture in CI once)."""
    for rank in (0, 1):
        at_end = json.load(open(os.path.join(zero3_run[1], f"at_end_rank{rank}.json")))
        assert at_end == {"after_run": True, "after_exit_handlers": False}, (rank, at_end)


@pytest.mark.slow
def test_zero3_model_loads_partitioned(zero3_run):
    """zero.Init at load: before the Trainer exists, every base weight is a ZeRO-3 parameter
    whose full tensor is not held by the process (only its partition, in ds_tensor)."""
    at_load = json.load(open(os.path.join(zero3_run[1], "at_load.json")))
    assert at_load["base_zero_params"] == at_load["base_params"] > 0, at_load
    assert at_load["base_local_numel"] == 0 and at_load["base_full_numel"] > 0, at_load


@pytest.mark.slow
def test_zero3_lora_checkpoints_are_complete(zero3_run):
    """Every saved adapter tensor is non-empty and equals the gathered in-memory value."""
    import torch
    from safetensors.torch import load_file
    run_dir, capture = zero3_run
    for step in (2, 4):
        saved = load_file(os.path.join(run_dir, f"checkpoint-{step}", "adapter_model.safetensors"))
        memory = load_file(os.path.join(capture, f"step{step}.safetensors"))
        assert saved.keys() == memory.keys() and len(saved) == 2 * 7 * 2  # A, B x 7 x 2 layers
        for name, tensor in saved.items():
            assert tensor.numel() > 0 and tensor.shape == memory[name].shape, name
            assert torch.equal(tensor, memory[name]), name
        assert any(t.abs().sum() > 0 for n, t in saved.items() if "lora_B" in n)  # trained


@pytest.mark.slow
def test_zero3_resume_same_world_size_continues_exactly(zero3_run, tmp_path):
    run_dir, _ = zero3_run
    run([sys.executable, "-m", "swiftlite.cli", "sft", *TRAIN, "--per_device_train_batch_size",
         "2", "--save_steps", "100", "--deepspeed", "zero3", "--output_dir", tmp_path,
         "--resume_from_checkpoint", os.path.join(run_dir, "checkpoint-2")],
        child_env(NPROC_PER_NODE=2, MASTER_PORT=free_port()))
    resumed = losses(the_run_dir(tmp_path))
    assert [s for s, _, _ in resumed] == [3, 4]
    assert_same_losses(resumed, losses(run_dir)[2:])


@pytest.mark.slow
def test_zero3_resume_with_other_world_size_stops_clearly(zero3_run, tmp_path):
    ckpt = os.path.join(zero3_run[0], "checkpoint-2")
    assert ds.saved_world_size(ckpt) == 2
    r = run_cli("sft", *TRAIN, "--deepspeed", "zero3", "--output_dir", tmp_path,
                "--resume_from_checkpoint", ckpt, env=child_env(), check=False)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "written by 2 processes and this run has 1" in r.stderr and "Traceback" not in r.stderr
    assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_zero3_checkpoint_merges_and_answers(zero3_run, tmp_path):
    import swiftlite
    merged = swiftlite.merge_lora(os.path.join(zero3_run[0], "checkpoint-4"),
                                  output_dir=str(tmp_path / "merged"))
    assert os.path.exists(os.path.join(merged, "config.json"))
    answer = swiftlite.infer(ckpt_dir=merged, query="Who are you?", max_new_tokens=8)
    assert isinstance(answer, str)


@pytest.mark.slow
def test_zero2_offload_runs_and_learns_like_adamw(single, tmp_path):
    """offload_optimizer: cpu runs DeepSpeed's CPU Adam (JIT-built once, ~70 s, then cached)."""
    run_cli("sft", *TRAIN, "--per_device_train_batch_size", "2", "--save_steps", "100",
            "--deepspeed", "zero2_offload", "--output_dir", tmp_path,
            env=child_env(NPROC_PER_NODE=2, MASTER_PORT=free_port()))
    # DeepSpeedCPUAdam instead of torch's AdamW: measured equal to ~2e-6 as well.
    assert_same_losses(losses(the_run_dir(tmp_path)), single)


@pytest.mark.slow
def test_zero3_full_fine_tuning_consolidates_to_a_plain_model(tiny_qwen2, tmp_path):
    """Also NEFTune (noise on the partitioned embeddings' output); its noise differs per rank, so
    the losses are only checked to be finite."""
    import math

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    run_cli("sft", *TRAIN[:4], "--max_steps", "2", "--save_steps", "2", "--train_type", "full",
            "--per_device_train_batch_size", "2", "--learning_rate", "1e-3", "--report_to",
            "none", "--neftune_noise_alpha", "5", "--logging_steps", "1",
            "--deepspeed", "zero3", "--output_dir", tmp_path / "run",
            env=child_env(NPROC_PER_NODE=2, MASTER_PORT=free_port()))
    run_dir = the_run_dir(tmp_path / "run")
    assert [s for s, _, _ in losses(run_dir)] == [1, 2]
    assert all(math.isfinite(loss) for _, loss, _ in losses(run_dir))
    ckpt = os.path.join(run_dir, "checkpoint-2")
    out = ds.consolidate(ckpt, str(tmp_path / "plain"))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).state_dict()
    gathered = load_file(os.path.join(ckpt, "model.safetensors"))  # the Trainer's 16-bit gather
    state = model.state_dict()
    for name, tensor in gathered.items():
        assert torch.allclose(state[name], tensor.float(), atol=1e-6), name
    assert any(not torch.equal(state[n], base[n]) for n in base)  # the weights were trained
    with pytest.raises(UsageError, match="no ZeRO checkpoint"):
        ds.consolidate(out)  # a plain model folder has nothing to consolidate


@pytest.mark.slow
def test_python_api_runs_in_one_process_each_get_their_own_backend(tmp_path):
    """The Python API, three runs in one fresh process: ZeRO-2, plain, ZeRO-3. A DeepSpeed run
    on a plain process starts a process group of one and accelerate's DeepSpeed state; before
    sft undid them at its end, the plain run after it silently trained under DeepSpeed, and a
    second DeepSpeed run failed on DeepSpeed's stale group references. Each run must use the
    backend it asked for, learn the same, and leave the environment as it found it.
    With 4 accumulated micro-batches of 1: accelerate warns that its 1 step differs from
    DeepSpeed's 4 (the Trainer accumulates itself); the equal losses show that is harmless."""
    script = f"""
import glob, json, os, sys
import swiftlite
from swiftlite.config.arguments import SftArguments
from swiftlite.config.argv import parse_argv
before = dict(os.environ)
for deepspeed in ("zero2", "", "zero3"):
    out = os.path.join({str(tmp_path)!r}, deepspeed or "plain")
    argv = {TRAIN[:6]!r} + {TRAIN[8:]!r} + ["--gradient_accumulation_steps", "4",
        "--per_device_train_batch_size", "1", "--save_steps", "4", "--output_dir", out]
    result = swiftlite.sft(parse_argv(SftArguments, argv + (["--deepspeed", deepspeed]
                                                            if deepspeed else []), "test", ""))
    changed = sorted(k for k in set(os.environ) | set(before) if os.environ.get(k) !=
                     before.get(k) and not k.startswith(("TORCH", "PYTORCH")))
    print("RESULT", json.dumps({{"run": result.output_dir, "deepspeed": deepspeed,
        "zero_checkpoint": bool(glob.glob(os.path.join(result.last_checkpoint, "global_step*"))),
        "env_changed": changed}}), flush=True)
"""
    r = run([sys.executable, "-c", script], child_env())
    results = [json.loads(line[7:]) for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert [x["deepspeed"] for x in results] == ["zero2", "", "zero3"], r.stdout[-3000:]
    plain = losses(results[1]["run"])
    assert len(plain) == 4
    for x in results:
        assert x["zero_checkpoint"] == bool(x["deepspeed"]), x
        assert x["env_changed"] == [], x
        assert_same_losses(losses(x["run"]), plain)
    # Library noise users cannot act on is hidden (sft's run scope): accelerate's mismatch
    # warning, torch's renamed collectives under ZeRO-3, transformers' v6 renames.
    for hidden in ("Gradient accumulation steps mismatch", "is deprecated and will be removed "
                   "in v6", "`torch.distributed.reduce_scatter_tensor` is deprecated",
                   "unable to detect"):
        assert hidden not in r.stderr, (hidden, r.stderr[-3000:])


@pytest.mark.slow
def test_zero3_loads_partitioned_on_the_gpu_branch_with_two_ranks(tmp_path):
    """ZeRO-3 model loading as on a GPU/NPU host (Hardware("cuda") given by hand, so the CPU
    enablement that starts the process group early is skipped), 2 ranks under torchrun:
    zero.Init parsed its config before the group existed and rejected a train_batch_size of 2
    (`2 != 1 * 1 * 1`) on every rank. Each rank must load its half of the weights."""
    run([os.path.join(BIN, "torchrun"), "--nproc_per_node", 2, "--master_port", free_port(),
         os.path.join(REPO, "tests", "helpers", "zero3_init_gpu_branch.py"), tmp_path], child_env())
    held = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    assert [h["world"] for h in held] == [2, 2]
    assert all(h["partitioned"] for h in held)
    full = held[0]["full_numel"]
    assert all(h["local_numel"] * 2 == full for h in held), held


@pytest.mark.parametrize("version, reentrant", [("0.19.2", True), ("0.19.3", False)])
def test_zero3_under_a_deepspeed_without_its_fix_checkpoints_reentrant(tiny_qwen2, monkeypatch,
                                                                       capsys, version,
                                                                       reentrant):
    """DeepSpeed before 0.19.3 fails ZeRO-3 under non-reentrant checkpointing (its #8148):
    swiftlite then checkpoints reentrant, and the LoRA weights get the same gradients as
    under the non-reentrant kind. Simulated: the DeepSpeed version (the installed one has the
    fix) and ZeRO-3's mark on a partitioned weight (ds_id), so that the choice is made as on
    a GPU host; the training itself is real."""
    import deepspeed
    import torch

    from helpers.speedups import _assert_close_grads, _grads, _samples
    from swiftlite.config.arguments import SftArguments
    from swiftlite.models.loader import load_model
    from swiftlite.training.tuners import prepare_model

    def lora_grads(mark_zero3: bool):
        torch.manual_seed(0)
        base = load_model(tiny_qwen2, "float32")
        if mark_zero3:
            next(base.parameters()).ds_id = 0
        model = prepare_model(base, SftArguments(model="x", dataset=["x"], lora_dropout=0.0,
                                                 fused_lora=False), "cpu")
        modes = {m._gradient_checkpointing_func.keywords["use_reentrant"]
                 for m in model.modules() if hasattr(m, "_gradient_checkpointing_func")}
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
        model.train()
        for s in samples:
            model(input_ids=torch.tensor([s["input_ids"]]),
                  labels=torch.tensor([s["labels"]])).loss.backward()
        return modes, _grads(model)

    _, samples = _samples(tiny_qwen2)
    monkeypatch.setattr(deepspeed, "__version__", version)
    modes, grads = lora_grads(mark_zero3=True)
    assert modes == {reentrant}
    assert ("using reentrant checkpointing" in capsys.readouterr().err) == reentrant
    plain_modes, plain = lora_grads(mark_zero3=False)
    assert plain_modes == {False}
    _assert_close_grads(grads, plain)


@pytest.mark.slow
def test_an_offload_preset_without_a_compiler_stops_before_the_model_loads(tmp_path):
    """CPU Adam is compiled on first use: with no working C++ compiler (CXX=/bin/false, and an
    empty extension cache so that nothing built before is reused) the run stops at once with
    what to install, not with a build log at the first step; no run folder is made."""
    r = run_cli("sft", *TRAIN, "--deepspeed", "zero2_offload", "--output_dir", tmp_path / "out",
                env=child_env(CXX="/bin/false", TORCH_EXTENSIONS_DIR=tmp_path / "ext"),
                check=False)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "needs DeepSpeed's CPU Adam, and it could not be built here" in r.stderr
    assert "apt install build-essential" in r.stderr and "--deepspeed zero2" in r.stderr
    assert "Traceback" not in r.stderr and "loading weights" not in r.stderr.lower()
    assert not os.path.exists(tmp_path / "out") or not os.listdir(tmp_path / "out")
