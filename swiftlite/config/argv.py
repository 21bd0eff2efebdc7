"""Command-line arguments -> an arguments dataclass: a parser generated from the dataclass
(flags = field names, `--max-length` also accepted), an optional config file first, and
`--name value` pairs for fields the parser does not list (TrainingArguments pass-through,
the Web-UI's extra-arguments box)."""
from __future__ import annotations

import argparse
import dataclasses

from swiftlite.errors import UsageError

CONFIG_EXTS = (".yaml", ".yml", ".json")


def build_parser(cls, prog: str, description: str, epilog: str = "") -> argparse.ArgumentParser:
    """An argparse parser generated from an arguments dataclass (flags = field names)."""
    from swiftlite.config.parsing import base_type
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
        if is_list:  # a flag given twice adds to it: --dataset a.jsonl --dataset b.jsonl
            kw.update(nargs="+", action="extend", metavar="VALUE")
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
    from swiftlite.config.parsing import build, load_config_file
    values, where = {}, "command line"
    if argv and not argv[0].startswith("-") and argv[0].endswith(CONFIG_EXTS):
        values = load_config_file(argv[0])
        where = f"command line or config file {argv[0]}"
        argv = argv[1:]
    parser = build_parser(cls, prog, description, epilog)
    ns, rest = parser.parse_known_args(_joined_negative_numbers(argv))
    values.update(vars(ns))
    values.update(flag_pairs(rest))
    return build(cls, values, where=where)


def _joined_negative_numbers(argv: list[str]) -> list[str]:
    """`--flag -1e-4` -> `--flag=-1e-4`: argparse (3.11) takes a negative number in exponent
    form for a flag of its own and stops with "expected one argument"."""
    out = []
    for tok in argv:
        if (tok.startswith("-") and out and out[-1].startswith("--") and "=" not in out[-1]
                and _is_number(tok)):
            out[-1] = f"{out[-1]}={tok}"
        else:
            out.append(tok)
    return out


def _is_number(tok: str) -> bool:
    try:
        float(tok)
    except ValueError:
        return False
    return True


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
