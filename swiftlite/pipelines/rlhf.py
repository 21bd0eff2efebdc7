"""`swiftlite rlhf`: preference pairs -> template -> encode -> model + LoRA -> preference
Trainer -> output folder, the same run folder and checkpoints as `swiftlite sft`.

Reads top to bottom like sft; the shared steps are training.run's. Pairs are read and checked
before any model is loaded.
"""
from __future__ import annotations

import os
import time

from swiftlite.config.parsing import build
from swiftlite.config.rlhf_args import NEEDS_REFERENCE, RlhfArguments
from swiftlite.data import load_datasets
from swiftlite.data.encode import UNTRAINED_END_OF_TURN, describe, warn_if_end_of_turn_untrained
from swiftlite.data.pair_encode import IDENTICAL, encode_preferences, show_pair
from swiftlite.data.pairs import unpair
from swiftlite.errors import UsageError
from swiftlite.log import info, is_main_process, warn
from swiftlite.models.registry import check_model_name
from swiftlite.training.run import TrainResult


def main(argv: list[str]) -> None:
    """`swiftlite rlhf [CONFIG] --flag value ...`: relaunched under torchrun when asked."""
    from swiftlite.config.argv import parse_argv
    from swiftlite.training.deepspeed import presets_help
    args = parse_argv(RlhfArguments, argv, "swiftlite rlhf",
                      "Preference training (DPO and its loss types, ORPO, SimPO, CPO, KTO) with "
                      "LoRA.", epilog="Every other transformers TrainingArguments field is "
                      "accepted as --name value. --deepspeed presets: " + presets_help())
    args.validate()
    from swiftlite.runtime.imports import leave_out_unused
    leave_out_unused(args)  # before anything imports peft or the Trainer
    from swiftlite.pipelines.sft import preflight
    preflight(args)
    from swiftlite.training.launch import maybe_relaunch
    maybe_relaunch(args, "rlhf")
    rlhf(args)


def rlhf(args: RlhfArguments | dict | None = None, **kwargs) -> TrainResult:
    """Python API: `swiftlite.rlhf(model="tiny-qwen2", dataset=["pairs.jsonl"], max_steps=10)`."""
    if args is None or isinstance(args, dict):
        args = build(RlhfArguments, {**(args or {}), **kwargs}, where="swiftlite.rlhf")
    elif kwargs:
        raise UsageError("swiftlite.rlhf: pass an RlhfArguments object or keyword arguments, "
                         "not both.")
    args.validate()
    from swiftlite.config.parsing import to_dict
    from swiftlite.config.secrets import secret_values
    from swiftlite.log import hide
    hide(secret_values(to_dict(args)))
    from swiftlite.pipelines.sft import preflight
    preflight(args)
    check_model_name(args.model)
    vars(args).pop("_deepspeed_auto", None)
    from swiftlite.runtime.distributed import run_scope
    with run_scope():
        return _run(args)


def _read(args: RlhfArguments):
    """(train rows or None when streamed, validation rows or None, LoadReport or None): every
    row checked, file:line on a bad one; KTO's paired rows split into a desirable and an
    undesirable row each."""
    num_proc = args.dataset_num_proc or len(os.sched_getaffinity(0))
    common = dict(seed=args.data_seed, skip_bad_rows=args.skip_bad_rows,
                  task=_task(args), num_proc=num_proc)
    train = val = report = None
    if args.streaming:  # read as training goes; only a --val_dataset is read now
        from swiftlite.data.stream import check_specs
        check_specs(args.dataset)
    else:
        loaded = load_datasets(args.dataset, split_ratio=0.0 if args.val_dataset else
                               args.split_dataset_ratio, **common)
        train, val, report = loaded.train, loaded.val or None, loaded.report
        info(f"dataset: {report.summary()}")
    if args.val_dataset:
        val = load_datasets(args.val_dataset, **common).train
    if args.rlhf_type == "kto":
        train, val = (unpair(list(x)) if x else x for x in (train, val))
        if train:
            pos = sum(r["label"] for r in train)
            info(f"kto: {pos} desirable and {len(train) - pos} undesirable rows")
    return train, val, report


def _task(args: RlhfArguments) -> str:
    """The loader's task: KTO takes labelled rows and pairs, the other methods pairs alone
    (a file of labelled rows is refused by its first row's file:line)."""
    return "preference" if args.rlhf_type == "kto" else "pairs"


def _stream(args: RlhfArguments, template, tokenizer):
    """--streaming: (the training stream, its StreamReport); the first row shown now."""
    from swiftlite.data.pair_encode import PAIR_ENCODER, UNPAIRED_ENCODER
    from swiftlite.data.stream import first_sample, stream_dataset
    kto = args.rlhf_type == "kto"
    options = dict(max_length=args.max_length, truncation_strategy=args.truncation_strategy,
                   skip_bad_rows=args.skip_bad_rows, task=_task(args),
                   encoder=UNPAIRED_ENCODER if kto else PAIR_ENCODER,
                   prepare=unpair if kto else None)
    first = first_sample(args.dataset, template, **options)
    info(f"dataset: streaming {' '.join(args.dataset)} (nothing read upfront; shuffle buffer "
         f"{args.shuffle_buffer_size} rows)")
    if is_main_process():
        info("first row:\n" + show_pair(first, tokenizer))
        _check_end_of_turn([first], args, template)
    return stream_dataset(args.dataset, template, seed=args.data_seed,
                          buffer_size=args.shuffle_buffer_size, **options)


def _encode(rows, name: str, args: RlhfArguments, template):
    return encode_preferences(rows, template, unpaired=args.rlhf_type == "kto",
                              max_length=args.max_length,
                              truncation_strategy=args.truncation_strategy, name=name,
                              use_cache=args.load_from_cache_file,
                              skip_bad_rows=args.skip_bad_rows,
                              num_proc=args.dataset_num_proc or len(os.sched_getaffinity(0)))


def _check_end_of_turn(ds, args: RlhfArguments, template) -> int:
    """The chosen reply (KTO: each reply) must end with a trained end-of-turn token, or the
    aligned model learns replies that never stop."""
    kto = args.rlhf_type == "kto"
    return warn_if_end_of_turn_untrained(ds, template, args.max_length,
                                  column="labels" if kto else "chosen_labels",
                                  what="rows" if kto else "pairs' chosen replies")


def _show(train_ds, report, val_report, args: RlhfArguments, tokenizer) -> None:
    what = "rows" if args.rlhf_type == "kto" else "pairs"
    if len(train_ds) == 0:
        raise UsageError(f"no {what} left after encoding: " + describe(
            report, "train", args.max_length) + "\nRaise --max_length or use "
            "--truncation_strategy right.")
    if is_main_process():
        info(describe(report, f"train {what}", args.max_length) + "\n  (lengths: the tokens "
             "of a pair, chosen and rejected together)" * (what == "pairs"))
        if val_report is not None:
            info(describe(val_report, f"val {what}", args.max_length))
        info(f"first {what[:-1]}:\n" + show_pair(train_ds[0], tokenizer))
    if report.dropped.get(IDENTICAL):
        warn(f"{report.dropped[IDENTICAL]} pair(s) have the same chosen and rejected reply: "
             "they teach nothing (kept and counted)")


def _loss_config(args: RlhfArguments):
    from swiftlite.training.preference.losses import LossConfig
    return LossConfig(args.rlhf_type, args.resolved_loss_type(), args.resolved_beta(),
                      args.label_smoothing, args.rpo_alpha, args.simpo_gamma, args.cpo_alpha,
                      args.desirable_weight, args.undesirable_weight)


def _run(args: RlhfArguments) -> TrainResult:
    t_start = time.time()
    from swiftlite.training import run
    hw, dtype = run.hardware_and_dtype(args)

    # 1. Pairs: read and validate every row before loading anything heavy.
    train_rows, val_rows, load_report = _read(args)

    # 2. Model folder, tokenizer and template; the pairs encoded with it (cached on disk).
    model_dir, model_info, tokenizer, template = run.model_and_template(args)
    val_ds, val_report = _encode(val_rows, "val", args, template) if val_rows else (None, None)
    stream_report = None
    if args.streaming:
        train_ds, stream_report = _stream(args, template, tokenizer)
        data_report = {"streaming": True, "shuffle_buffer_size": args.shuffle_buffer_size}
    else:
        train_ds, report = _encode(train_rows, "train", args, template)
        _show(train_ds, report, val_report, args, tokenizer)
        untrained = _check_end_of_turn(train_ds, args, template) if is_main_process() else 0
        data_report = {**report.to_dict(), "rows": load_report.rows, UNTRAINED_END_OF_TURN: untrained,
                       "skipped_rows": dict(load_report.skipped)}

    # 3. Model + LoRA (new adapters, or an SFT checkpoint's going on training).
    adapter = args.adapters[0] if args.adapters else None
    model, zero3 = run.load_for_training(args, model_dir, hw, dtype, adapter)  # noqa: F841
    tokenizer.chat_template = template.to_jinja()

    # 4. The reference: the model with its adapters off, computed with each batch; or once,
    # before training (asked for; an SFT adapter that goes on training; full fine-tuning; a
    # PiSSA/OLoRA init, whose adapters switched off leave a residual of the base).
    from swiftlite.training.preference.collator import PreferenceCollator
    collator = PreferenceCollator(tokenizer.pad_token_id or 0, args.padding_free)
    precompute = args.rlhf_type in NEEDS_REFERENCE and (
        args.precompute_ref_log_probs or adapter is not None or args.train_type == "full"
        or args.mutated_init)
    if precompute:
        from swiftlite.training.preference.reference import with_reference_logps
        train_ds = with_reference_logps(model, train_ds, report, collator, args, hw, adapter,
                                        dtype)
        if val_ds is not None:
            val_ds = with_reference_logps(model, val_ds, val_report, collator, args, hw, adapter,
                                          dtype)

    # 5. The Trainer, then the run folder with every resolved argument.
    from swiftlite.training.preference.trainer import preference_trainer_class
    from swiftlite.training.trainer import build_trainer
    trainer, run_dir = run.start_run(args, hw, lambda run_dir: build_trainer(
        model, tokenizer, train_ds, val_ds, args, run_dir, dtype, hw,
        trainer_cls=preference_trainer_class(), data_collator=collator,
        loss_config=_loss_config(args)))
    run.write_args(run_dir, args, **run.resolved_run(args, model_dir, model_info, template,
                                                     dtype, hw),
                   loss_type=args.resolved_loss_type(), beta=args.resolved_beta(),
                   reference="precomputed" if precompute else (
                       "the model with its adapters off" if args.rlhf_type in NEEDS_REFERENCE
                       else "none"),
                   dataset_report=data_report)

    # 6. Train, then the reward plots beside the loss plot.
    metrics, last = run.train(trainer, args, hw, run_dir, val_ds is not None, t_start,
                              stream_report)
    if is_main_process():
        from swiftlite.training.plots import plot_rewards
        plot_rewards(run_dir)
    return TrainResult(run_dir, last, metrics)
