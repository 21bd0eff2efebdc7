"""The steps every training method shares (sft, rlhf): hardware and dtype, the model with LoRA
or QLoRA, the run folder with args.json, and training under the OOM guard with its reports.
A method's pipeline reads its data and builds its trainer; everything else is a call here."""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

from swiftlite.data.template import get_template
from swiftlite.log import info, is_main_process, warn
from swiftlite.models import resolve_model
from swiftlite.models.loader import load_tokenizer
from swiftlite.runtime import hardware
from swiftlite.runtime.output import create_run_dir, last_checkpoint, remove_if_empty


@dataclass
class TrainResult:
    """What a training command returns (swiftlite.sft, swiftlite.rlhf)."""
    output_dir: str  # the run folder: <output_dir>/v<N>-<timestamp>
    last_checkpoint: str | None
    metrics: dict


def hardware_and_dtype(args):
    """(hardware.Hardware, training dtype), both said in the log with why."""
    from swiftlite.runtime.allocator import describe as allocator_line
    info(allocator_line())
    hw = hardware.detect()
    dtype = hardware.training_dtype(args.torch_dtype, hw, args.train_type, args.deepspeed,
                                    quantized=args.quant_bits is not None)
    how = ""
    if args.torch_dtype in (None, "auto"):
        cpu_bf16 = hw.device == "cpu" and dtype == "bfloat16"
        how = " (--torch_dtype auto" + (": bf16 frozen base, fp32 activations, LoRA and "
                                        "optimizer; --torch_dtype float32 for all fp32" if cpu_bf16
                                        else "") + ")"
    # On a CPU the dtype follows its flags (hardware.CPU_BF16_FLAGS): name them, so a run log
    # from another machine says why it chose what it did.
    where = f"cpu ({hardware.describe_cpu()})" if hw.device == "cpu" else hw.device
    info(f"training on {where} in {dtype}{how}")
    hardware.warn_if_emulated_bf16(dtype, hw)
    if hw.device == "cpu":
        from swiftlite.runtime.allocator import describe_onednn_caches
        info(describe_onednn_caches())
    return hw, dtype


def model_and_template(args):
    """(model folder, its ModelInfo, tokenizer, template): the template said in the log, with a
    warning when a base model is given a chat template it never learned."""
    model_dir, model_info = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir, args.trust_remote_code)
    template = get_template(args.template or model_info.template, tokenizer, system=args.system,
                            loss_scale=args.loss_scale, enable_thinking=args.enable_thinking)
    info(f"template: {template.describe()}; system prompt: {template.default_system!r}")
    if args.train_type == "lora" and not model_info.is_chat and template.name != "default":
        warn(f"{args.model} is a base model and its {template.describe()} ends turns with "
             f"{template.end_of_turn!r}, a token it never learned; LoRA trains it only through "
             "the adapters. Consider --template default, or the -Instruct model.")
    return model_dir, model_info, tokenizer, template


def resolved_run(args, model_dir: str, model_info, template, dtype: str, hw) -> dict:
    """What args.json records beyond the arguments: what they resolved to on this machine."""
    from swiftlite.models.base_check import fingerprint
    return {"model_dir": model_dir, "template": template.name,
            "template_source": template.describe(), "system": template.saved_system,
            "torch_dtype": dtype, "hardware": hw.device,
            "model_type": "chat" if model_info.is_chat else "base",
            "base_config": fingerprint(model_dir)}  # merge-lora checks its base against it


def load_for_training(args, model_dir: str, hw, dtype: str, adapter: str | None = None):
    """(the model ready to train: LoRA adapters (new, or `adapter`'s weights to go on
    training), checkpointing and the speed-ups; the ZeRO-3 context to keep alive)."""
    from swiftlite.models.loader import load_model, quantization_config
    from swiftlite.models.targets import check_target_modules_before_loading
    from swiftlite.training.deepspeed import check_cpu_adam, resolve, zero3_init
    if args.train_type == "lora" and adapter is None:
        check_target_modules_before_loading(model_dir, args.target_modules,
                                            args.trust_remote_code, args.init_lora_weights,
                                            args.modules_to_save)
    check_cpu_adam(args, hw)
    zero3 = zero3_init(args, hw, dtype)  # kept alive by the caller: ZeRO-3 loads partitioned
    quant = quantization_config(vars(args), dtype)
    if quant is not None:
        info(f"QLoRA: the frozen base in {args.quant_bits} bits (bitsandbytes" + (
            f", {args.bnb_4bit_quant_type}{', double quant' if args.bnb_4bit_use_double_quant else ''}"
            if args.quant_bits == 4 else ", LLM.int8") + f"), computing in {dtype}")
    weights = hardware.weights_dtype(dtype, args.train_type, resolve(args, hw) is not None)
    if weights != dtype:
        info(f"full fine-tuning in {dtype}: fp32 master weights, {dtype} compute by autocast")
    model = load_model(model_dir, weights,
                       trust_remote_code=args.trust_remote_code,
                       attn_impl=args.attn_impl or hardware.attn_implementation(hw, dtype),
                       quantization=quant)
    from transformers import set_seed

    from swiftlite.training.tuners import prepare_model
    set_seed(args.seed)  # same LoRA init in every run and on every rank (loss parity, resume)
    return prepare_model(model, args, hw.device, adapter=adapter), zero3


def start_run(args, hw, make_trainer):
    """(trainer, run folder): the folder is agreed on by every rank, the trainer built by
    make_trainer(run_dir) under the OOM guard, and the folder made only once that worked, so a
    mistake found while setting up leaves no half-made run."""
    from swiftlite.training.launch import agree_run_dir
    from swiftlite.training.oom import oom_guard
    run_dir = agree_run_dir(args)  # the same on every rank (rank 0 claims it)
    try:
        with oom_guard(args, hw):  # the Trainer moves the model to the GPU: it may not fit
            trainer = make_trainer(run_dir)
    except BaseException:
        remove_if_empty(run_dir)
        raise
    create_run_dir(run_dir)
    return trainer, run_dir


def write_args(run_dir: str, args, **resolved) -> None:
    """args.json: every argument as resolved for this run, secrets redacted."""
    from swiftlite.config.parsing import to_dict
    from swiftlite.config.secrets import redact, redact_argv
    full = {**to_dict(args), **resolved,
            "command": os.environ.get("SWIFTLITE_COMMAND") or " ".join(redact_argv(sys.argv))}
    if is_main_process():
        with open(os.path.join(run_dir, "args.json"), "w") as f:
            json.dump(redact(full), f, indent=2, ensure_ascii=False, default=str)
        info(f"output folder: {run_dir}")


def train(trainer, args, hw, run_dir: str, has_eval: bool, t_start: float,
          stream_report=None) -> tuple[dict, str | None]:
    """(metrics, last checkpoint): Trainer.train under the OOM guard (an OOM is answered with
    the next step of the tuning ladder), the final evaluation, the plots and metrics.json.
    stream_report: --streaming's data.stream.StreamReport, said and kept in the metrics."""
    from swiftlite.training.oom import oom_guard
    from swiftlite.training.plots import plot_losses
    if args.resume_from_checkpoint:
        info(f"resuming from {args.resume_from_checkpoint}")
    info(f"ready to train after {time.time() - t_start:.1f} s")
    from swiftlite.runtime import gc_start
    gc_start.release(freeze=True)  # what the run holds now, it keeps to the end
    try:
        with oom_guard(args, hw):
            result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    except BaseException as e:
        from swiftlite.training.failures import explain
        instead = explain(e, args, run_dir, started=getattr(trainer, "trained_a_step", False))
        if instead is None:
            raise
        raise instead from e
    if is_main_process():
        from swiftlite.runtime import prefetch
        prefetch.record()  # the files this start read, for the next start to read ahead
    metrics = dict(result.metrics)
    if stream_report is not None:
        info(f"stream: {stream_report.summary()}")
        metrics["dataset_stream"] = stream_report.to_dict()
    if has_eval:
        metrics.update(trainer.evaluate())
    state = trainer.state
    if args.early_stopping_patience and state.global_step < state.max_steps:
        info(f"stopped early at step {state.global_step} of {state.max_steps}: "
             f"{trainer.args.metric_for_best_model} did not improve for "
             f"{args.early_stopping_patience} evaluation(s)")
        metrics["stopped_early_at_step"] = state.global_step
    if state.best_model_checkpoint:
        info(f"best checkpoint: {state.best_model_checkpoint} "
             f"({trainer.args.metric_for_best_model} {state.best_metric:.4f})")
        metrics["best_model_checkpoint"] = state.best_model_checkpoint
    last = last_checkpoint(run_dir)
    if is_main_process():
        plot_losses(run_dir)
        with open(os.path.join(run_dir, "metrics.json"), "w") as f:
            json.dump(metrics, f, indent=2)
        info(f"done: {run_dir}" + (f"; last checkpoint {last}" if last else ""))
    return metrics, last
