"""`swiftlite sft`: data -> template -> encode -> model + LoRA -> Trainer -> output folder.

Reads top to bottom; each step is a call into a part. Data is read and validated before any
model is loaded, so a bad row costs seconds, not a model load.
"""
from __future__ import annotations

import os
import time

from swiftlite.config.arguments import SftArguments
from swiftlite.config.parsing import build, to_dict
from swiftlite.data import load_conversations, load_datasets
from swiftlite.data.encode import (UNTRAINED_END_OF_TURN, describe, encode_dataset, load_cached,
                                   show_sample, warn_if_end_of_turn_untrained)
from swiftlite.data.loader import LoadReport
from swiftlite.errors import UsageError
from swiftlite.log import info, is_main_process
from swiftlite.models.registry import check_model_name
from swiftlite.training.run import TrainResult


def main(argv: list[str]) -> None:
    """`swiftlite sft [CONFIG] --flag value ...`: relaunched under torchrun when asked."""
    from swiftlite.config.argv import parse_argv
    from swiftlite.training.deepspeed import presets_help  # light: the preset file names only
    args = parse_argv(SftArguments, argv, "swiftlite sft", "LoRA supervised fine-tuning.",
                      epilog="Every other transformers TrainingArguments field is accepted as "
                             "--name value (e.g. --report_to none --eval_strategy no). "
                             "--deepspeed presets: " + presets_help())
    args.validate()
    from swiftlite.runtime.imports import leave_out_unused
    leave_out_unused(args)  # before anything imports peft or the Trainer
    preflight(args)
    from swiftlite.training.launch import maybe_relaunch
    maybe_relaunch(args)
    sft(args)


def preflight(args: SftArguments) -> None:
    """Checks of the output folder and the resume checkpoint, before anything is loaded or
    any worker starts."""
    from swiftlite.training.launch import check_output_dir
    from swiftlite.training.resume import resolve_resume
    check_output_dir(args)
    if args.deepspeed and str(args.deepspeed).strip() != "auto":
        from swiftlite.config.fields import raise_if
        from swiftlite.training.deepspeed import config_problems, load_config
        raise_if(config_problems(args, load_config(args.deepspeed)))
    if args.resume_from_checkpoint:
        ckpt = resolve_resume(args.resume_from_checkpoint, args.train_type, args.deepspeed)
        if ckpt != args.resume_from_checkpoint:
            info(f"resuming from {ckpt} (the last complete checkpoint of "
                 f"{args.resume_from_checkpoint})")
        args.resume_from_checkpoint = ckpt


def sft(args: SftArguments | dict | None = None, **kwargs) -> TrainResult:
    """Python API: `swiftlite.sft(model="tiny-qwen2", dataset=["data.jsonl"], max_steps=10)`."""
    if args is None or isinstance(args, dict):
        args = build(SftArguments, {**(args or {}), **kwargs}, where="swiftlite.sft")
    elif kwargs:
        raise UsageError("swiftlite.sft: pass an SftArguments object or keyword arguments, not both.")
    args.validate()
    from swiftlite.config.secrets import secret_values
    from swiftlite.log import hide
    hide(secret_values(to_dict(args)))
    preflight(args)
    check_model_name(args.model)  # a typo is reported before the data is read
    vars(args).pop("_deepspeed_auto", None)  # --deepspeed auto is decided anew for each run
    from swiftlite.runtime.distributed import run_scope
    with run_scope():
        return _run(args)


def _num_proc(args: SftArguments) -> int:
    return args.dataset_num_proc or len(os.sched_getaffinity(0))


def _read_data(args: SftArguments):
    """(train conversations, validation conversations or None, LoadReport), every row checked.
    A validation split comes from the distinct rows, before #N sampling repeats any."""
    loaded = load_datasets(
        args.dataset, seed=args.data_seed, skip_bad_rows=args.skip_bad_rows,
        model_name=args.model_name, model_author=args.model_author,
        split_ratio=0.0 if args.val_dataset else args.split_dataset_ratio,
        num_proc=_num_proc(args))
    train_convs, val_convs, load_report = loaded.train, loaded.val or None, loaded.report
    if args.val_dataset:
        val_convs = _read_val(args)
    info(f"dataset: {load_report.summary()}")
    return train_convs, val_convs, load_report


def _read_val(args: SftArguments) -> list:
    """The --val_dataset conversations, every row checked."""
    convs, _ = load_conversations(args.val_dataset, seed=args.data_seed,
                                  skip_bad_rows=args.skip_bad_rows, model_name=args.model_name,
                                  model_author=args.model_author)
    return convs


def _encode(convs, name: str, args: SftArguments, template, num_proc: int):
    return encode_dataset(convs, template, max_length=args.max_length,
                          truncation_strategy=args.truncation_strategy, name=name,
                          use_cache=args.load_from_cache_file,
                          skip_bad_rows=args.skip_bad_rows, num_proc=num_proc)


def _show(train_ds, enc_report, val_report, args: SftArguments, template, tokenizer) -> int:
    """The counts, the first sample as training sees it and the longest one; a warning when
    the end of a turn is never trained. Returns how many samples' is not (merge-lora and
    deploy repeat it)."""
    if len(train_ds) == 0:
        raise UsageError("no samples left after encoding: " + describe(
            enc_report, "train", args.max_length) + "\nRaise --max_length or use "
            "--truncation_strategy right.")
    if is_main_process():
        info(describe(enc_report, "train", args.max_length))
        if val_report is not None:
            info(describe(val_report, "val", args.max_length))
        info("first sample:\n" + show_sample(train_ds[0], tokenizer))
        lengths = enc_report.lengths
        longest = max(range(len(lengths)), key=lengths.__getitem__)
        info(f"longest sample: #{longest}, {lengths[longest]} tokens")
    return warn_if_end_of_turn_untrained(train_ds, template, args.max_length) \
        if is_main_process() else 0


def _stream(args: SftArguments, template, tokenizer, num_proc: int):
    """--streaming: (the training stream, val dataset or None, its EncodeReport or None, the
    StreamReport that counts as training reads)."""
    from swiftlite.data.stream import first_sample, stream_dataset
    options = dict(max_length=args.max_length, truncation_strategy=args.truncation_strategy,
                   skip_bad_rows=args.skip_bad_rows, model_name=args.model_name,
                   model_author=args.model_author)
    first = first_sample(args.dataset, template, **options)
    train_ds, report = stream_dataset(args.dataset, template, seed=args.data_seed,
                                      buffer_size=args.shuffle_buffer_size, **options)
    val_ds = val_report = None
    if args.val_dataset:
        val_ds, val_report = _encode(_read_val(args), "val", args, template, num_proc)
        info(describe(val_report, "val", args.max_length))
    info(f"dataset: streaming {' '.join(args.dataset)} (nothing read upfront; shuffle buffer "
         f"{args.shuffle_buffer_size} samples)")
    info("first sample:\n" + show_sample(first, tokenizer))
    warn_if_end_of_turn_untrained([first], template)
    return train_ds, val_ds, val_report, report


def _run(args: SftArguments) -> TrainResult:
    t_start = time.time()
    from swiftlite.training import run
    hw, dtype = run.hardware_and_dtype(args)

    # 1. Data: read and validate every row before loading anything heavy; unless these very
    # files were read and encoded before (data.manifest), then the model comes first.
    from swiftlite.data import manifest
    fkey = manifest.files_key(args) if args.load_from_cache_file and not args.streaming else None
    warm = manifest.known(fkey)
    if args.streaming:  # read as training goes; only a --val_dataset is read now
        from swiftlite.data.stream import check_specs
        check_specs(args.dataset)
    elif not warm:
        train_convs, val_convs, load_report = _read_data(args)

    # 2. Model folder, tokenizer and template.
    model_dir, model_info, tokenizer, template = run.model_and_template(args)

    # 3. Encode (cached on disk), split, and show what training will see.
    num_proc = _num_proc(args)
    stream_report = None
    if args.streaming:
        train_ds, val_ds, val_report, stream_report = _stream(args, template, tokenizer,
                                                              num_proc)
        data_report = {"streaming": True, "shuffle_buffer_size": args.shuffle_buffer_size}
    else:
        ekey = manifest.encoding_key(template, args.max_length, args.truncation_strategy)
        hit = manifest.lookup(fkey, ekey) if warm else None
        train = hit and load_cached(hit["train"], "train", args.skip_bad_rows)
        val = hit and (load_cached(hit["val"], "val", args.skip_bad_rows) if hit["val"]
                       else (None, None))
        if train and val:  # (a cache entry swept meanwhile: read the data after all)
            load_report = LoadReport.from_dict(hit["load_report"])
            info(f"dataset: {load_report.summary()} (these files were read before: "
                 "--load_from_cache_file false reads them again)")
            (train_ds, enc_report), (val_ds, val_report) = train, val
        else:
            if warm:  # the files are known, but not with this template or max_length
                train_convs, val_convs, load_report = _read_data(args)
            train_ds, enc_report = _encode(train_convs, "train", args, template, num_proc)
            del train_convs  # the encoded rows are memory-mapped; the dicts can go
            val_ds, val_report = _encode(val_convs, "val", args, template, num_proc) \
                if val_convs else (None, None)
            if fkey and enc_report.cache_path and (val_report is None or val_report.cache_path):
                manifest.save(fkey, ekey, {"load_report": load_report.to_dict(),
                                           "train": enc_report.cache_path,
                                           "val": val_report.cache_path if val_report else None})
        untrained = _show(train_ds, enc_report, val_report, args, template, tokenizer)
        data_report = {**enc_report.to_dict(), "rows": load_report.rows,
                       "skipped_rows": dict(load_report.skipped),
                       UNTRAINED_END_OF_TURN: untrained}
        if args.packing:
            from swiftlite.data.packing import PackedDataset
            train_ds = PackedDataset(train_ds, enc_report.lengths, args.max_length)
            info(train_ds.describe())
            data_report["packing"] = train_ds.stats

    # 4. Model + LoRA. The saved tokenizer carries the training template, so the checkpoint
    # renders prompts exactly as trained, with or without swiftlite.
    model, zero3 = run.load_for_training(args, model_dir, hw, dtype)  # noqa: F841 (kept alive)
    # The model's own template is kept byte for byte (unless --system changed what it renders).
    tokenizer.chat_template = template.to_jinja()

    # 5. The Trainer, then the run folder with every resolved argument.
    from swiftlite.training.trainer import build_trainer
    trainer, run_dir = run.start_run(args, hw, lambda run_dir: build_trainer(
        model, tokenizer, train_ds, val_ds, args, run_dir, dtype, hw))
    run.write_args(run_dir, args, **run.resolved_run(args, model_dir, model_info, template, dtype,
                                                 hw), dataset_report=data_report)

    # 6. Train.
    metrics, last = run.train(trainer, args, hw, run_dir, val_ds is not None, t_start,
                              stream_report)
    return TrainResult(run_dir, last, metrics)
