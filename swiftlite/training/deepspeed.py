"""DeepSpeed for the Trainer: presets, "auto" values, CPU-only enablement, resume checks and
ZeRO-3 consolidation.

`--deepspeed` is a preset name (zero0 ... zero3_offload, JSON files shipped in
swiftlite/deepspeed_configs), a path to a JSON file, or an inline JSON string. The "auto"
values in a config (batch sizes, accumulation, clipping, optimizer values, fp16/bf16) are
filled from the TrainingArguments by transformers' own DeepSpeed integration; swiftlite only
loads the config and makes it work where accelerate alone would not (CPU-only hosts).
"""
from __future__ import annotations

import glob
import json
import logging
import os
import re
from importlib import resources

from swiftlite.config.constants import STAGES
from swiftlite.errors import RunError, UsageError
from swiftlite.log import info



def preset_names() -> list[str]:
    files = resources.files("swiftlite.training.deepspeed_configs")
    return sorted(p.name[:-5] for p in files.iterdir() if p.name.endswith(".json"))


def presets_help() -> str:
    """The presets and what each partitions, for `swiftlite sft --help` (argparse reflows it)."""
    return "; ".join(f"{name}: {STAGES.get(name, 'shipped preset')}"
                     for name in preset_names()) + "; auto: the fastest of these (or none) " \
        "that fits this hardware, per `swiftlite estimate`."


# What the Trainer decides from its own arguments; transformers fills only the keys a config
# has as "auto", and DeepSpeed stops without a batch size (after the model has loaded)
TRAINER_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "train_batch_size", "gradient_clipping")


def load_config(value) -> dict:
    """The DeepSpeed config dict for a preset name, JSON file path, inline JSON or dict, with
    TRAINER_KEYS it leaves out as "auto"."""
    config = _read_config(value)
    for key in TRAINER_KEYS:
        config.setdefault(key, "auto")
    return config


def _read_config(value) -> dict:
    if isinstance(value, dict):
        return json.loads(json.dumps(value))  # a private copy: HF fills "auto" in place
    text = str(value).strip()
    names = preset_names()
    choices = (f"use a preset ({', '.join(names)}), auto (the fastest that fits, per "
               "`swiftlite estimate`), a path to a DeepSpeed JSON file, or inline JSON such as "
               "'{\"zero_optimization\": {\"stage\": 2}}'")
    if text in names:
        with resources.files("swiftlite.training.deepspeed_configs").joinpath(f"{text}.json").open() as f:
            return json.load(f)
    if text.startswith("{"):
        config, where = _parse_json(text, "inline JSON"), "inline JSON"
    elif os.path.isfile(text):
        with open(text, encoding="utf-8") as f:
            config, where = _parse_json(f.read(), text), text
    else:
        raise UsageError(f"--deepspeed {text}: not a preset and no such file; {choices}.")
    if not isinstance(config, dict):
        raise UsageError(f"--deepspeed {where}: expected a JSON object, got "
                         f"{type(config).__name__}; {choices}.")
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise UsageError(f"--deepspeed {where}: zero_optimization.stage must be 0, 1, 2 or 3, "
                         f"got {stage!r}.")
    return config


def _parse_json(text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--deepspeed {where}: malformed JSON at line {e.lineno} column "
                         f"{e.colno}: {e.msg}. Presets: {', '.join(preset_names())}.") from None


def zero_stage(config: dict) -> int:
    return int((config.get("zero_optimization") or {}).get("stage", 0))


def config_problems(args, config: dict) -> list[str]:
    """What this run refuses in a loaded DeepSpeed config: a quantized base under ZeRO-3, and
    the LoRA variants' ZeRO-3 and offload refusals (which the preset names alone miss)."""
    from swiftlite.config.arguments import QUANT_ZERO3
    problems = []
    if getattr(args, "quant_bits", None) is not None and zero_stage(config) == 3:
        problems.append(f"--quant_bits with a ZeRO-3 config: {QUANT_ZERO3}")
    if args.train_type == "lora":
        problems += args.placement_problems(config)
    return problems


def resolve(args, hw) -> dict | None:
    """The config for args.deepspeed; "auto" takes `swiftlite estimate`'s recommendation
    (None when it says plain training fits)."""
    if not args.deepspeed:
        return None
    value = args.deepspeed
    if isinstance(value, str) and value.strip() == "auto":
        # Decided once per run (setup asks again: CPU Adam, ZeRO-3 loading, the Trainer).
        if "_deepspeed_auto" not in vars(args):
            args._deepspeed_auto = recommended_preset(args, hw)
        value = args._deepspeed_auto
        if value is None:
            return None
    return load_config(value)


def recommended_preset(args, hw) -> str | None:
    """The fastest preset that fits this hardware per `swiftlite estimate` of this very run
    (None: no DeepSpeed needed). Memory figures come from the devices actually present."""
    import psutil

    from swiftlite.estimate.plan import for_training, recommend
    from swiftlite.runtime.hardware import resolve_dtype
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = max(1, int(os.environ.get("WORLD_SIZE", "1")) // local)
    host = psutil.virtual_memory().total
    device_memory = _device_memory(hw) or host // local  # CPU-only: the host's share
    choice = recommend(for_training(args, torch_dtype=resolve_dtype(args.torch_dtype, hw),
                                    gpus=local, nodes=nodes, gpu_memory=device_memory,
                                    cpu_memory=host))
    if not choice.fits:
        raise UsageError(f"--deepspeed auto: no configuration fits ({choice.reason}). See "
                         f"`swiftlite estimate --model {args.model}`.")
    if choice.quant_bits and args.quant_bits is None:  # never quantize behind the user's back
        raise UsageError(f"--deepspeed auto: {choice.reason}. Add --quant_bits "
                         f"{choice.quant_bits} to train it that way (QLoRA), or see `swiftlite "
                         f"estimate --model {args.model}` for the other options.")
    if choice.deepspeed:
        problems = config_problems(args, load_config(choice.deepspeed))
        if problems:
            raise UsageError(f"--deepspeed auto: {choice.deepspeed} fits this run, but "
                             + "; ".join(problems) + f". See `swiftlite estimate --model "
                             f"{args.model}` for the other options.")
    if choice.gradient_checkpointing and not args.gradient_checkpointing:
        from swiftlite.log import warn
        warn("--deepspeed auto: the estimate needs --gradient_checkpointing true to fit.")
    reason = choice.reason
    from swiftlite.config.sizes import gib
    if hw.device == "cpu":  # the estimate speaks of GPUs; here a process's share of the host
        reason = reason.replace("per GPU", "per process").replace(
            f"of {gib(device_memory)})", f"of {gib(device_memory)} host memory per process)")
    info(f"--deepspeed auto: {choice.deepspeed or 'no DeepSpeed'} ({reason})")
    return choice.deepspeed


def _device_memory(hw) -> int | None:
    import torch
    if hw.device == "cuda":
        return torch.cuda.get_device_properties(0).total_memory
    if hw.device == "npu":
        return torch.npu.get_device_properties(0).total_memory
    return None


def _name_the_cpu(hw) -> None:
    if hw.device == "cpu":  # accelerate imports DeepSpeed on every run, which then warns that
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # it found no GPU: say it is a CPU


def check_cpu_adam(args, hw) -> None:
    """An optimizer offloaded to the CPU runs DeepSpeed's CPU Adam, a C++ op compiled on its
    first use: compile (or load) it now, before the model loads, so that a machine without a
    compiler gets one clear error instead of a build log at the first step. Every rank asks;
    torch's extension lock lets one build while the others wait for it; a lock that a killed
    build left would make them wait forever, so those go first (runtime/build_locks.py)."""
    if not args.deepspeed:
        return
    from swiftlite.runtime.build_locks import clear_stale
    clear_stale()
    config = resolve(args, hw)
    offload = ((config or {}).get("zero_optimization") or {}).get("offload_optimizer") or {}
    if offload.get("device") not in ("cpu", "nvme"):
        return
    _name_the_cpu(hw)
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder
        CPUAdamBuilder().load(verbose=False)
    except Exception as e:  # noqa: BLE001 - a failed build raises whatever the toolchain gives
        last = (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]
        raise RunError(
            f"--deepspeed {args.deepspeed} offloads the optimizer to the CPU, which needs "
            f"DeepSpeed's CPU Adam, and it could not be built here ({last}). Install a C++ "
            "compiler and the Python headers (Debian/Ubuntu: apt install build-essential "
            "python3-dev), or install DeepSpeed with it prebuilt (DS_BUILD_CPU_ADAM=1 pip "
            "install deepspeed --no-cache-dir); or train without offloading (--deepspeed "
            "zero2 or zero3).") from None


def training_kwargs(args, hw) -> dict:
    """Extra TrainingArguments for args.deepspeed: the config dict, and on a CPU-only host
    the accelerate state that makes DeepSpeed see all processes."""
    _name_the_cpu(hw)
    config = resolve(args, hw)
    if config is None:
        return {}
    _single_process_env()
    _no_shm_all_reduce()
    if args.resume_from_checkpoint:
        check_resume(args.resume_from_checkpoint)
    kwargs = {"deepspeed": config}
    _quiet_accumulation_mismatch()
    if _enable_on_cpu(hw):
        kwargs["accelerator_config"] = {"use_configured_state": True}
    return kwargs


class _AccumulationMismatch(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Gradient accumulation steps mismatch" not in record.getMessage()


def _quiet_accumulation_mismatch() -> None:
    """The Trainer accumulates gradients itself and so gives accelerate 1 step; accelerate then
    warns on every DeepSpeed run with --gradient_accumulation_steps > 1 that it takes
    DeepSpeed's value. Both mean the same thing: ZeRO-2 and ZeRO-3 learn exactly as a plain
    run with accumulation (tests/e2e/test_deepspeed.py), so the warning only alarms users. The
    filter stays for the rest of the process: it hides that one message and nothing else."""
    logger = logging.getLogger("accelerate.accelerator")
    if not any(isinstance(f, _AccumulationMismatch) for f in logger.filters):
        logger.addFilter(_AccumulationMismatch())


def _enable_on_cpu(hw) -> bool:
    """accelerate enables DeepSpeed only when an accelerator is present; without one the
    Trainer sees a world size of 1 and DeepSpeed rejects the batch size. Configuring the
    state ourselves (gloo) and telling the Trainer to use it is what works (FACTS.md)."""
    if hw.device != "cpu":
        return False
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    from accelerate import PartialState
    PartialState(backend="gloo")
    return True


def _no_shm_all_reduce() -> None:
    """DeepSpeed's communication backend loads its shared-memory all-reduce on its CPU
    accelerator as it starts: a C++ op compiled for about a minute on a machine's first
    DeepSpeed run, whose ranks then each map a 67 MB buffer in /dev/shm and never remove it.
    Only its inference all-reduce (tensor-parallel inference) uses the op; training reduces
    through torch.distributed. DeepSpeed skips an op its table marks incompatible, and keeps
    the table for edits such as this one."""
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def zero3_init(args, hw, dtype: str):
    """Under ZeRO-3, an HfDeepSpeedConfig that the caller keeps alive while the model loads:
    transformers then builds the model inside deepspeed.zero.Init, each process holding only
    its partition, so a model larger than one device (or one rank's share of host RAM)
    loads at all. None for other stages. The Trainer later takes over with its own config."""
    config = resolve(args, hw)
    if config is None or zero_stage(config) != 3:
        return None
    _single_process_env()
    _no_shm_all_reduce()
    _enable_on_cpu(hw)
    # zero.Init reads only the partitioning and dtype settings, but the config must parse:
    # the Trainer fills the "auto" values later, here any valid value does. No
    # train_batch_size: zero.Init parses the config before it starts the process group, so
    # DeepSpeed sees a world size of 1 then, and a total batch stated for the real world size
    # fails its batch check on a GPU host (on a CPU host _enable_on_cpu has started the group
    # already). Left out, DeepSpeed derives it from the other two for whatever world it sees.
    init = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": dtype == "bfloat16" and hw.device != "cpu"},
            "fp16": {"enabled": dtype == "float16"},
            "zero_optimization": {k: v for k, v in config["zero_optimization"].items()
                                  if v != "auto"}}
    from transformers.integrations import HfDeepSpeedConfig
    return HfDeepSpeedConfig(init)


def _single_process_env() -> None:
    """DeepSpeed always needs a process group; give a plain `swiftlite sft` run one of size 1."""
    if "WORLD_SIZE" in os.environ:
        return
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def saved_world_size(ckpt_dir: str) -> int | None:
    """How many data-parallel processes wrote this DeepSpeed checkpoint (None: not one)."""
    steps = sorted(glob.glob(os.path.join(ckpt_dir, "global_step*")))
    if not steps:
        return None
    ranks = {m.group(1) for f in os.listdir(steps[-1])
             if (m := re.match(r".*zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$", f))}
    if not ranks:  # ZeRO-0: one model_states file per model-parallel rank, no ZeRO shards
        return None
    return len(ranks)


def check_resume(ckpt_dir: str, world: int | None = None) -> None:
    """Stop before any work when a ZeRO checkpoint was written by another number of
    processes: its optimizer shards cannot be re-partitioned on load."""
    from swiftlite.runtime.distributed import world_size
    saved, now = saved_world_size(ckpt_dir), world or world_size()
    if saved is not None and saved != now:
        raise UsageError(
            f"--resume_from_checkpoint {ckpt_dir}: this ZeRO checkpoint was written by {saved} "
            f"processes and this run has {now}. ZeRO splits the optimizer states per process, so "
            f"resume with {saved} processes (NPROC_PER_NODE x NNODES = {saved}), or start a new "
            "run from the weights (consolidate them with swiftlite.training.deepspeed.consolidate).")


def consolidate(ckpt_dir: str, output_dir: str | None = None, tokenizer: bool = True) -> str:
    """A plain transformers model folder from a ZeRO checkpoint of a full fine-tuning run.

    Uses DeepSpeed's own zero_to_fp32 to merge the fp32 master weights of every process (works
    for ZeRO-1/2/3 and any number of processes, on one CPU), then writes them with the
    checkpoint's config as safetensors. Returns the output folder (<ckpt>-fp32 by default).
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from swiftlite.models.loader import save_tokenizer
    if saved_world_size(ckpt_dir) is None:
        raise UsageError(f"{ckpt_dir}: no ZeRO checkpoint (global_step*/ with optimizer shards) "
                         "to consolidate.")
    if os.path.exists(os.path.join(ckpt_dir, "adapter_config.json")):
        raise UsageError(f"{ckpt_dir} is a LoRA checkpoint: its adapter is saved complete; use "
                         "`swiftlite merge-lora --ckpt_dir` instead.")
    output_dir = output_dir or ckpt_dir.rstrip("/") + "-fp32"
    state = get_fp32_state_dict_from_zero_checkpoint(ckpt_dir)
    config = AutoConfig.from_pretrained(ckpt_dir)
    import torch
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise UsageError(f"{ckpt_dir}: the ZeRO checkpoint lacks {len(missing)} weights "
                         f"(e.g. {missing[0]}); was it written by a full fine-tuning run?")
    model.save_pretrained(output_dir, safe_serialization=True)
    if tokenizer:
        try:
            save_tokenizer(AutoTokenizer.from_pretrained(ckpt_dir), output_dir)
        except (OSError, ValueError):
            pass  # a checkpoint without tokenizer files: the weights are still usable
    info(f"consolidated {ckpt_dir} -> {output_dir}")
    return output_dir
