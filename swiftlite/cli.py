"""The `swiftlite` command: a table from command name to function, with lazy imports so that
`--help` answers at once. Errors a user can fix are printed without a traceback
(exit 2 for usage/config errors, 1 for failures during a run)."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys

from .errors import SwiftliteError, UsageError

# command -> (module:function taking argv, one-line description)
COMMANDS = {
    "sft": ("swiftlite.cli:sft_main", "LoRA (or full) supervised fine-tuning"),
    "merge-lora": ("swiftlite.pipelines.merge:main", "merge a LoRA checkpoint into a plain model"),
    "infer": ("swiftlite.pipelines.infer:main", "chat with a model or checkpoint, or batch-infer a "
                                                "dataset"),
    "estimate": ("swiftlite.pipelines.estimate:main", "estimate training memory per GPU for each "
                                                      "DeepSpeed stage"),
    "web-ui": ("webui.app:main", "start the Gradio Web-UI"),
}
CONFIG_EXTS = (".yaml", ".yml", ".json")
# Commands that run a model: worth tcmalloc's lower peak memory (see allocator.py).
ALLOCATOR_COMMANDS = ("sft", "infer", "merge-lora")


def build_parser(cls, prog: str, description: str, epilog: str = "") -> argparse.ArgumentParser:
    """An argparse parser generated from an arguments dataclass (flags = field names)."""
    from .parsing import base_type
    p = argparse.ArgumentParser(
        prog=prog, description=description, epilog=epilog, allow_abbrev=False,
        usage=f"{prog} [CONFIG.yaml] [--flag value ...]",
        formatter_class=lambda prog: argparse.HelpFormatter(prog, max_help_position=34))
    order = ["model", "data", "tuner", "train", ""]
    fields = sorted(dataclasses.fields(cls), key=lambda f: order.index(f.metadata.get("group", ""))
                    if f.metadata.get("group", "") in order else len(order))
    groups = {}
    for f in fields:
        group = f.metadata.get("group", "")
        if group == "hidden":
            continue
        if group not in groups:
            groups[group] = p.add_argument_group(f"{group} arguments" if group else "arguments")
        scalar, is_list = base_type(f.type)
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        help_text = f.metadata.get("help", "")
        if default not in (None, [], ""):
            shown = " ".join(map(str, default)) if isinstance(default, list) else str(default).lower() \
                if isinstance(default, bool) else default
            help_text += f" (default: {shown})"
        kw = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        choices = f.metadata.get("choices")
        if is_list:
            kw.update(nargs="+", metavar="VALUE")
        elif scalar is bool:
            kw.update(nargs="?", const="true", metavar="true|false")
        elif choices:
            kw.update(metavar="{" + ",".join(choices) + "}")
        else:
            kw.update(metavar=scalar.__name__.upper())
        groups[group].add_argument(f"--{f.name}", **kw)
        if "_" in f.name:  # --max-length works too; listed once in --help
            groups[group].add_argument(f"--{f.name.replace('_', '-')}",
                                       **{**kw, "help": argparse.SUPPRESS})
    return p


def parse_argv(cls, argv: list[str], prog: str, description: str, epilog: str = ""):
    """Config file (optional, first) + flags -> validated-ready dataclass instance."""
    from .parsing import build, load_config_file
    values, where = {}, "command line"
    if argv and not argv[0].startswith("-") and argv[0].endswith(CONFIG_EXTS):
        values = load_config_file(argv[0])
        where = f"command line or config file {argv[0]}"
        argv = argv[1:]
    parser = build_parser(cls, prog, description, epilog)
    ns, rest = parser.parse_known_args(argv)
    values.update(vars(ns))
    values.update(flag_pairs(rest))
    return build(cls, values, where=where)


def flag_pairs(tokens: list[str], where: str = "command line") -> dict:
    """`--name value [value ...]` pairs (e.g. TrainingArguments fields the generated parser does
    not know) -> {name: value or [values]}; a bare `--flag` means true. `build` checks names.
    Shared with the Web-UI's extra-arguments box."""
    out, name = {}, None
    for tok in tokens:
        if tok.startswith("--"):
            name, _, val = tok[2:].partition("=")
            name = name.replace("-", "_")
            out[name] = [val] if val else []
        elif name is None:
            raise UsageError(f"{where}: unexpected {tok!r}; write --name value pairs, "
                             "e.g. --report_to none")
        else:
            out[name].append(tok)
    return {k: (v[0] if len(v) == 1 else ("true" if not v else v)) for k, v in out.items()}


def _deepspeed_presets() -> str:
    from .deepspeed import presets_help  # light: reads the preset file names only
    return presets_help()


def sft_main(argv: list[str]) -> None:
    from .arguments import SftArguments
    args = parse_argv(SftArguments, argv, "swiftlite sft", "LoRA supervised fine-tuning.",
                      epilog="Every other transformers TrainingArguments field is accepted as "
                             "--name value (e.g. --report_to none --eval_strategy no). "
                             "--deepspeed presets: " + _deepspeed_presets())
    args.validate()
    from .launch import maybe_relaunch
    maybe_relaunch(args)
    from .pipelines.sft import sft
    sft(args)


def main(argv: list[str] | None = None) -> int:
    own_process = argv is None  # the `swiftlite` command itself, not a call from Python
    argv = list(sys.argv[1:] if argv is None else argv)
    # The `deepspeed` launcher puts --local_rank=N before the command; LOCAL_RANK says the same.
    argv = [a for a in argv if not a.startswith(("--local_rank=", "--local-rank="))]
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: swiftlite COMMAND [--flag value ...]\n\ncommands:")
        for name, (_, desc) in COMMANDS.items():
            print(f"  {name:<12} {desc}")
        print("\n`swiftlite COMMAND --help` lists a command's flags.")
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from . import __version__
        print(f"swiftlite {__version__}")
        return 0
    command = argv[0]
    if command not in COMMANDS:
        import difflib
        close = difflib.get_close_matches(command, COMMANDS, n=1)
        print(f"swiftlite: unknown command {command!r}" + (f"; did you mean {close[0]!r}?" if close
              else f"; commands: {', '.join(COMMANDS)}"), file=sys.stderr)
        return 2
    if own_process and command in ALLOCATOR_COMMANDS and not {"-h", "--help"} & set(argv):
        from .allocator import reexec_with_tcmalloc  # returns unless it re-executes
        reexec_with_tcmalloc(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from .log import hide_library_noise
    hide_library_noise()
    target, _ = COMMANDS[command]
    module, func = target.split(":")
    try:
        getattr(importlib.import_module(module), func)(argv[1:])
    except SwiftliteError as e:
        print(f"swiftlite {command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"swiftlite {command}: interrupted", file=sys.stderr)
        return 130
    _end_process_group()
    return 0


def _end_process_group() -> None:
    """A torchrun rank that trained ends its process group before exiting: left to the
    interpreter's teardown, gloo's threads can abort a finished run ("terminate called without
    an active exception", seen once in a ZeRO-2 offload test)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
