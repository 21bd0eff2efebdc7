"""What a checkpoint folder is and what inference needs from it, read from the folder alone.

A folder is either a LoRA adapter (adapter_config.json; the base model comes from the run's
args.json, a --model override, or the adapter's own base_model_name_or_path), or a model
(config.json: a full fine-tuning checkpoint, a merged model, any transformers model). The
template, system prompt and dtype come from args.json (written by sft) or swiftlite.json
(written by merge-lora and the model builders); any of them can be overridden.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from swiftlite.errors import UsageError

_UNSET = object()
# The arguments that choose how prompts are rendered (infer, deploy, eval, merge, export)
TEMPLATE_FIELDS = ("template", "system", "enable_thinking")


@dataclass
class CheckpointInfo:
    path: str  # the checkpoint (adapter) or model folder
    kind: str  # "adapter" | "model"
    base_dir: str | None  # adapters: the base model folder
    template: str
    system: object = _UNSET  # _UNSET: the template's default; None: no system prompt
    torch_dtype: str | None = None  # the training dtype, if known
    run_args: dict = field(default_factory=dict)
    is_chat: bool = True
    enable_thinking: bool | None = None  # the thinking switch it was trained with (None: default)
    thinking_known: bool = False  # args.json / swiftlite.json says how it was trained

    @property
    def model_dir(self) -> str:
        """The folder holding the full weights (the base model for adapters)."""
        return self.base_dir if self.kind == "adapter" else self.path

    def system_or(self, default):
        return default if self.system is _UNSET else self.system

    def template_for(self, tokenizer):
        """The template that renders prompts as this checkpoint was trained (or as overridden)."""
        from swiftlite.data.template import get_template
        return get_template(self.template, tokenizer, system=self.system_or(None),
                            enable_thinking=self.enable_thinking)

    def tokenizer_dir(self) -> str:
        """The checkpoint's own tokenizer (it carries the training chat template) if saved."""
        has_tok = any(os.path.exists(os.path.join(self.path, f)) for f in (
            "tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
        return self.path if has_tok else self.model_dir


def training_template(ckpt: CheckpointInfo, trust_remote_code: bool = False):
    """(tokenizer, template) that render prompts as the checkpoint was trained: its own
    tokenizer, its template and --system. What deploy's vLLM backend and export hand on (the
    template's to_jinja() and stop_token_ids())."""
    from swiftlite.models.loader import load_tokenizer
    tokenizer = load_tokenizer(ckpt.tokenizer_dir(), trust_remote_code, torch_free=True)
    return tokenizer, ckpt.template_for(tokenizer)


def warn_if_trained_without_end_of_turn(path: str) -> None:
    """merge-lora's and deploy's pre-flight: a checkpoint whose run had samples that did not
    end with a trained end-of-turn token (args.json's count) gives a model that may not stop."""
    from swiftlite.data.encode import UNTRAINED_END_OF_TURN
    report = read_json(os.path.join(path, "args.json")).get("dataset_report") or {}
    missing = report.get(UNTRAINED_END_OF_TURN)
    if missing:
        from swiftlite.log import warn
        warn(f"{path} was trained on {missing} samples "
             "whose reply did not end with a trained end-of-turn token (see the run's log): it "
             "may not stop by itself. Generation still ends at --max_new_tokens.")


def read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: not valid JSON ({e}).") from None


def describe(ckpt_dir: str | None = None, model: str | None = None, *, template: str | None = None,
             system=_UNSET, torch_dtype: str | None = None,
             enable_thinking: bool | None = None) -> CheckpointInfo:
    """Resolve --ckpt_dir / --model (+ overrides) to a CheckpointInfo. Raises UsageError."""
    from swiftlite.models.loader import is_adapter_dir
    from swiftlite.models.registry import resolve_model
    if ckpt_dir is None and model and os.path.isdir(model) and is_adapter_dir(model):
        ckpt_dir, model = model, None  # `--model checkpoint-50`: an adapter is a checkpoint
    if ckpt_dir is None:
        if not model:
            raise UsageError("give --ckpt_dir (a checkpoint or merged folder) or --model.")
        model_dir, minfo = resolve_model(model)
        saved = read_json(os.path.join(model_dir, "swiftlite.json"))
        info = CheckpointInfo(model_dir, "model", None, minfo.template, is_chat=minfo.is_chat,
                              torch_dtype=saved.get("torch_dtype"))
        if "system" in saved:
            info.system = saved["system"]
        info.enable_thinking = saved.get("enable_thinking")
        info.thinking_known = "enable_thinking" in saved
    else:
        info = _describe_folder(ckpt_dir, model)
    if enable_thinking is not None:
        _warn_if_thinking_differs(info, enable_thinking)
        info.enable_thinking = enable_thinking
    if template:
        info.template = template
    if system is not _UNSET and system is not None:
        info.system = system
    if torch_dtype and torch_dtype != "auto":
        info.torch_dtype = torch_dtype
    return info


def _describe_folder(ckpt_dir: str, model: str | None) -> CheckpointInfo:
    from swiftlite.models.loader import is_adapter_dir
    from swiftlite.models.registry import guess_info, resolve_model
    if not os.path.isdir(ckpt_dir):
        raise UsageError(f"--ckpt_dir {ckpt_dir}: no such folder.")
    args = read_json(os.path.join(ckpt_dir, "args.json"))
    saved = read_json(os.path.join(ckpt_dir, "swiftlite.json"))
    if is_adapter_dir(ckpt_dir):
        base = model or _existing(args.get("model_dir")) or args.get("model") or read_json(
            os.path.join(ckpt_dir, "adapter_config.json")).get("base_model_name_or_path")
        if not base:
            raise UsageError(f"--ckpt_dir {ckpt_dir}: cannot tell which base model this adapter "
                             "belongs to (no args.json, no base_model_name_or_path). Pass --model.")
        try:
            base_dir, minfo = resolve_model(base)
        except UsageError as e:
            raise UsageError(f"the base model of {ckpt_dir} is not available: {e} Pass --model "
                             "with the base model's folder.") from None
        kind = "adapter"
    elif os.path.exists(os.path.join(ckpt_dir, "config.json")):
        base_dir, minfo, kind = None, guess_info(ckpt_dir), "model"
    else:
        from swiftlite.runtime.output import last_checkpoint
        last = last_checkpoint(ckpt_dir)
        hint = (f"This looks like a run folder: its last checkpoint is --ckpt_dir {last}"
                if last else "Pass a checkpoint-<step> folder of a run, or a merged model folder")
        raise UsageError(f"--ckpt_dir {ckpt_dir}: neither a LoRA checkpoint (no "
                         "adapter_config.json) nor a model folder (no config.json). "
                         f"{hint}.")
    info = CheckpointInfo(ckpt_dir, kind, base_dir,
                          args.get("template") or saved.get("template") or minfo.template,
                          torch_dtype=args.get("torch_dtype") or saved.get("torch_dtype"),
                          run_args=args, is_chat=saved.get("is_chat", minfo.is_chat))
    for src in (args, saved):
        if "system" in src:
            info.system = src["system"]
            break
    info.enable_thinking = args.get("enable_thinking", saved.get("enable_thinking"))
    info.thinking_known = "enable_thinking" in args or "enable_thinking" in saved
    return info


def _warn_if_thinking_differs(info: CheckpointInfo, asked: bool) -> None:
    """Qwen3 trained with thinking and served without (or the reverse) answers in a shape it
    never learned: say so (trained None is the template's default, thinking on)."""
    trained = True if info.enable_thinking is None else info.enable_thinking
    if info.thinking_known and asked != trained:
        from swiftlite.log import warn
        warn(f"--enable_thinking {str(asked).lower()}: {info.path} was trained with "
             f"enable_thinking {str(trained).lower()}; its replies may open or skip a think "
             "block where it learned the other. Leave the flag out to use the trained setting.")


def _existing(path):
    return path if path and os.path.isdir(path) else None

