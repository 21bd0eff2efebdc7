"""From names and values (CLI flags, a YAML/JSON config file, Web-UI fields, Python keyword
arguments) to the typed argument dataclasses of swiftlite.config.arguments: one conversion for every
front end, so a value means the same wherever it was typed, and a wrong one gets the same
error naming its flag."""
from __future__ import annotations

import dataclasses
import math
import json
import os
import types
import typing
from typing import Any, Optional

from swiftlite.config.ta_fields import training_arguments_fields
from swiftlite.errors import UsageError

_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def str2bool(value) -> bool:
    if isinstance(value, bool):
        return value
    v = str(value).strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def base_type(tp) -> tuple[type, bool]:
    """(scalar type, is_list) of an annotation such as Optional[list[str]]."""
    if isinstance(tp, str):
        tp = eval(tp, vars(typing), {"Optional": Optional, "Any": Any})  # noqa: S307
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        # Prefer the richest scalar the field accepts: bool/int/float before str.
        for pref in (list, bool, float, int):
            for a in args:
                if a is pref or typing.get_origin(a) is pref:
                    return base_type(a)
        return base_type(args[0]) if args else (str, False)
    if origin is list:
        (inner,) = typing.get_args(tp) or (str,)
        return base_type(inner)[0], True
    if tp in (bool, int, float, str):
        return tp, False
    return str, False  # enums, dicts given as JSON text, ...


def convert(value, tp, name: str):
    """Convert a CLI/YAML value to the field's type; raises UsageError naming the flag."""
    scalar, is_list = base_type(tp)
    if isinstance(value, dict) and _accepts(tp, dict):
        return value  # e.g. --deepspeed given as a mapping in a config file
    if is_list and _also_scalar(tp) and not (isinstance(value, list) and len(value) > 1):
        is_list = False  # e.g. report_to: "none" stays a string, two values become a list
    try:
        if value is None:
            return None
        if is_list:
            values = value if isinstance(value, list) else [value]
            return [_scalar(v, scalar) for v in values]
        if isinstance(value, list):
            if len(value) != 1:
                raise ValueError(f"expected one value, got {len(value)}")
            value = value[0]
        return _scalar(value, scalar)
    except (ValueError, TypeError) as e:
        raise UsageError(f"--{name}: {e}") from None


def _also_scalar(tp) -> bool:
    if isinstance(tp, str):
        tp = eval(tp, vars(typing), {"Optional": Optional, "Any": Any})  # noqa: S307
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else ()
    return any(a in (str, int, float, bool) for a in args)


def _accepts(tp, kind: type) -> bool:
    """Does the annotation take values of `kind` (e.g. dict in Union[dict, str])?"""
    if isinstance(tp, str):
        tp = eval(tp, vars(typing), {"Optional": Optional, "Any": Any})  # noqa: S307
    if tp is Any:
        return True
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return any(a is kind or typing.get_origin(a) is kind for a in args)


def _scalar(v, scalar):
    if isinstance(v, str) and v.lower() in ("none", "null") and scalar is not str:
        return None
    if v is False and scalar is str:  # YAML 1.1 reads an unquoted `no` as false
        return "no"
    if scalar is bool:
        return str2bool(v)
    if scalar is int:
        if isinstance(v, float) and not v.is_integer():
            raise ValueError(f"expected a whole number, got {v}")
        try:
            return int(v)
        except ValueError:
            raise ValueError(f"expected a whole number, got {v!r}") from None
    if scalar is float:
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise ValueError(f"expected a number, got {v!r}")
        try:
            x = float(v)
        except ValueError:
            raise ValueError(f"expected a number, got {v!r}") from None
        if not math.isfinite(x):  # nan poisons every step; inf steps to nowhere
            raise ValueError(f"expected a finite number, got {v!r}")
        return x
    if isinstance(v, str):
        return v
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)  # YAML reads `output_dir: 2024` as a number; the folder is "2024"
    kind = {dict: "a mapping", list: "a list"}.get(type(v), f"the {type(v).__name__} value")
    raise ValueError(f"expected text, got {kind} {v!r}; quote the value if it is meant as text")


def load_config_file(path: str) -> dict:
    if not os.path.isfile(path):
        raise UsageError(f"config file {path}: no such file.")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        if path.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml
            data = yaml.safe_load(text)
    except Exception as e:  # yaml.YAMLError / JSONDecodeError: both name a line
        raise UsageError(f"config file {path}: cannot parse it ({e}).") from None
    if not isinstance(data, dict):
        raise UsageError(f"config file {path}: expected a mapping of argument names to values.")
    return data


def build(cls, values: dict, *, where: str = "arguments"):
    """An instance of cls from a name -> value mapping (names may use - or _).

    Unknown names are checked against TrainingArguments when cls has `training_args`.
    """
    own = {f.name: f for f in dataclasses.fields(cls)}
    kwargs, extra, unknown = {}, {}, []
    ta_fields = None
    for raw_name, value in values.items():
        name = raw_name.replace("-", "_")
        try:
            if name in own and name != "training_args":
                kwargs[name] = convert(value, own[name].type, name)
            elif name == "training_args" and isinstance(value, dict):
                extra.update(value)
            elif "training_args" in own:
                ta_fields = ta_fields or training_arguments_fields()
                if name in ta_fields:
                    extra[name] = convert(value, ta_fields[name], name)
                else:
                    unknown.append(name)
            else:
                unknown.append(name)
        except UsageError as e:
            raise UsageError(f"{where}: {e}") from None
    if unknown:
        import difflib
        known = list(own) + (list(ta_fields or training_arguments_fields())
                             if "training_args" in own else [])
        hints = []
        for u in unknown:
            close = difflib.get_close_matches(u, known, n=1)
            hints.append(f"--{u}" + (f" (did you mean --{close[0]}?)" if close else ""))
        raise UsageError(f"{where}: unknown argument(s) {', '.join(hints)}.")
    if extra:
        kwargs["training_args"] = extra
    return cls(**kwargs)


def to_dict(args) -> dict:
    d = dataclasses.asdict(args)
    d.update(d.pop("training_args", {}) or {})
    return d
