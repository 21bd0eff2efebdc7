"""The Train form, generated from `RlhfArguments` (SFT's fields plus the preference group;
labels, help, choices, defaults and groups come from the dataclass metadata, so the form and the
CLI cannot drift apart), and the mapping

    stage + form values -> SftArguments or RlhfArguments (build + validate)
                        -> `swiftlite sft` or `swiftlite rlhf` argv

that the Preview shows and Start runs. Nothing here imports gradio: it is unit-tested alone.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex

from swiftlite.config.arguments import SftArguments
from swiftlite.config.rlhf_args import RlhfArguments
from swiftlite.config.parsing import base_type, build
from swiftlite.config.argv import flag_pairs
from swiftlite.errors import UsageError

# The fields the issue asks for up front, in this order; every other field of SftArguments is
# still in the form, in a collapsed "more ... arguments" section per group.
PRIMARY = ["model", "template", "system", "dataset", "model_name", "model_author", "lora_rank",
           "lora_alpha", "lora_dropout", "target_modules", "num_train_epochs", "max_steps",
           "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate",
           "max_length", "deepspeed", "output_dir"]
# Set by the Web-UI itself: every run gets its own v<N>-<timestamp> folder, which is how the runs
# list finds it and how two runs never share a folder; the method is the stage choice.
FIXED = {"add_version", "rlhf_type"}
GROUP_ORDER = ["model", "data", "tuner", "train", "rlhf"]
# The stage choice: SFT, or a preference method (rlhf's --rlhf_type)
STAGES = {"SFT": None, "DPO": "dpo", "ORPO": "orpo", "SimPO": "simpo", "CPO": "cpo",
          "KTO": "kto"}


def fields() -> list[dataclasses.Field]:
    """The form's fields: RlhfArguments (SFT's and the preference group) minus hidden ones and
    those the Web-UI fixes."""
    return [f for f in dataclasses.fields(RlhfArguments)
            if f.metadata.get("group") != "hidden" and f.name not in FIXED]


FIELDS = {f.name: f for f in fields()}


def default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def kind(f: dataclasses.Field) -> str:
    """'bool', 'choice', 'list' or 'text' (numbers are typed as text so that a bad number gets
    the same message as on the CLI instead of being silently dropped by a number box)."""
    scalar, is_list = base_type(f.type)
    if is_list:
        return "list"
    if scalar is bool:  # Optional[bool] (None: the default) is typed as true / false / empty
        return "bool" if default(f) is not None else "text"
    if f.metadata.get("choices"):
        return "choice"
    return "text"


def label(f: dataclasses.Field) -> str:
    return f.name


def info(f: dataclasses.Field) -> str:
    """The CLI's help text, with the default the way `--help` shows it."""
    text, d = f.metadata.get("help", ""), default(f)
    if kind(f) == "list":
        text += " (space-separated)"
    if d not in (None, [], "") and kind(f) != "bool":
        text += f" (default: {' '.join(map(str, d)) if isinstance(d, list) else d})"
    return text


def widget_value(f: dataclasses.Field, value) -> object:
    """A field value as the widget shows it (lists as shell words, None as empty)."""
    k = kind(f)
    if value is None:  # also Optional[bool]: empty means "auto", not false
        return ""
    if k == "bool":
        return bool(value)
    if k == "list":
        return shlex.join(map(str, value))
    return str(value)


def form_values(raw: dict, extra: str = "") -> dict:
    """Widget values (name -> value) and the 'extra arguments' text -> a name -> value mapping for
    `build`. Empty text boxes mean 'the default'."""
    values = {}
    for name, v in raw.items():
        f = FIELDS[name]
        k = kind(f)
        if k == "bool":
            values[name] = bool(v)
        elif v is None or (isinstance(v, str) and not v.strip()):
            continue
        elif k == "list":
            try:
                values[name] = shlex.split(v) if isinstance(v, str) else list(v)
            except ValueError as e:
                raise UsageError(f"--{name}: {e} (quote values containing spaces)") from None
        else:
            values[name] = v.strip() if isinstance(v, str) else v
    for name, v in parse_extra(extra).items():
        if name in values and name in FIELDS:
            raise UsageError(f"extra arguments: --{name} is already a field of the form; set it "
                             "there.")
        values[name] = v
    return values


def parse_extra(text: str) -> dict:
    """'--report_to none --eval_strategy no' -> {'report_to': 'none', 'eval_strategy': 'no'}."""
    try:
        words = shlex.split(text or "")
    except ValueError as e:
        raise UsageError(f"extra arguments: {e}") from None
    return flag_pairs(words, where="extra arguments")


def to_args(raw: dict, extra: str = "", *, output_root: str | None = None,
            policy=None, stage: str = "SFT") -> SftArguments:
    """Form -> validated SftArguments (stage SFT; the preference fields are not used) or
    RlhfArguments (a preference stage); one UsageError listing every problem, including what
    the operator's policy (webui.policy; by default the strictest one for output_root) does
    not allow."""
    if stage not in STAGES:
        raise UsageError(f"stage {stage!r}: choose one of {', '.join(STAGES)}")
    cls = RlhfArguments if STAGES[stage] else SftArguments
    if cls is SftArguments:
        raw = {k: v for k, v in raw.items() if FIELDS[k].metadata.get("group") != "rlhf"}
    if policy is None and output_root:
        from swiftlite.webui.policy import Policy
        policy = Policy(output_root)
    output_root = policy.root if policy else output_root
    values = form_values(raw, extra)
    if STAGES[stage]:
        values["rlhf_type"] = STAGES[stage]
    if output_root and values.get("model") and not values.get("output_dir"):
        from swiftlite.models.registry import model_name
        values["output_dir"] = os.path.join(output_root, model_name(values["model"]))
    problems, good = [], {}
    for name, value in values.items():  # convert field by field to report every bad one
        try:
            build(cls, {name: value}, where="form")
            good[name] = value
        except UsageError as e:
            problems.append(str(e))
    args = build(cls, good, where="form")
    try:
        args.validate()
    except UsageError as e:
        problems += [line.strip()[2:] for line in str(e).splitlines()[1:]]
    problems += check_paths(args)
    if policy is not None:
        problems += policy.sft_problems(args)
    if problems:
        raise UsageError("invalid arguments:\n  - " + "\n  - ".join(problems))
    return args


def check_paths(args: SftArguments) -> list[str]:
    """Typed paths must exist and be of the right kind; nothing is downloaded to check."""
    from swiftlite.data.files import BUILTIN, no_such_file, parse_spec
    from swiftlite.models.registry import MODELS, lookup
    problems = []
    m = args.model
    if m and lookup(m) is None:
        if os.path.isdir(m):
            if not os.path.isfile(os.path.join(m, "config.json")):
                problems.append(f"--model {m}: the folder has no config.json, so it is not a "
                                "Hugging Face model folder")
        elif os.path.exists(m):
            problems.append(f"--model {m}: is a file; give a model folder")
        elif m.startswith(("/", ".", "~")) or m.count("/") != 1:
            problems.append(f"--model {m}: no such folder, and not a hub id (org/name) or a known "
                            f"alias ({', '.join(MODELS)})")
    for spec in list(args.dataset) + list(args.val_dataset):
        try:
            path, _ = parse_spec(spec)
        except UsageError as e:
            problems.append(str(e).lstrip("-"))
            continue
        if path in BUILTIN:
            continue
        if not os.path.isfile(path):
            problems.append(no_such_file(path).rstrip("."))
    if isinstance(args.deepspeed, str) and args.deepspeed.endswith(".json") and \
            not os.path.isfile(args.deepspeed):
        problems.append(f"--deepspeed {args.deepspeed}: no such file")
    if args.template and os.sep in args.template and not os.path.isfile(args.template):
        problems.append(f"--template {args.template}: no such file")
    return problems


def command_argv(args) -> list[str]:
    """The flags for an arguments dataclass (SftArguments, MergeArguments, ...): every value
    that differs from its default, in the order `--help` lists them (model, data, tuner,
    train)."""
    argv = []
    order = GROUP_ORDER
    fixed = {"rlhf_type"} if isinstance(args, RlhfArguments) else set()

    def rank(f):
        g = f.metadata.get("group", "")
        return order.index(g) if g in order else len(order)

    for f in sorted(dataclasses.fields(args), key=rank):
        value = getattr(args, f.name)
        if f.name == "training_args" or (value == default(f) and f.name not in fixed):
            continue
        argv += _flag(f.name, value)
    for name, value in (getattr(args, "training_args", None) or {}).items():
        argv += _flag(name, value)
    return argv


def _flag(name: str, value) -> list[str]:
    if isinstance(value, bool):
        return [f"--{name}", "true" if value else "false"]
    if isinstance(value, (list, tuple)):
        return [f"--{name}", *map(str, value)] if value else []
    if isinstance(value, dict):
        return [f"--{name}", json.dumps(value)]
    return [f"--{name}", "none" if value is None else str(value)]


def command(args: SftArguments) -> str:
    """The swiftlite command these arguments are for."""
    return "rlhf" if isinstance(args, RlhfArguments) else "sft"


def preview(args: SftArguments, nproc: int = 1) -> str:
    """The exact shell command the form stands for, one flag per line."""
    argv = command_argv(args)
    lines = [(f"NPROC_PER_NODE={nproc} " if nproc > 1 else "") + f"swiftlite {command(args)}"]
    i = 0
    while i < len(argv):
        j = i + 1
        while j < len(argv) and not argv[j].startswith("--"):
            j += 1
        lines.append("  " + shlex.join(argv[i:j]))
        i = j
    return " \\\n".join(lines)
