"""The Export tab: merge a LoRA checkpoint into a plain model with `swiftlite merge-lora`, run as
a child process (the merge loads a full model; the Web-UI process stays small), log streamed.
The fields are MergeArguments' (the CLI's flags), like the Train form is SftArguments'."""
from __future__ import annotations

import dataclasses
import html
import os

import gradio as gr

from swiftlite.errors import SwiftliteError, UsageError

from swiftlite.webui import form
from swiftlite.webui.choices import is_adapter
from swiftlite.webui.widgets import checkpoint_picker, command_log, errors_html, field_widgets, run_child


def merge_fields():
    from swiftlite.config.arguments import MergeArguments
    # exist_ok is not offered: the Web-UI writes only new folders (webui.policy)
    return [f for f in dataclasses.fields(MergeArguments) if f.name not in ("ckpt_dir",
            "exist_ok") and f.metadata.get("group") != "hidden"]


def merge_args(ckpt_dir: str, values: dict, policy):
    """Widget values -> validated MergeArguments; typed paths checked; one UsageError."""
    from swiftlite.config.arguments import MergeArguments
    from swiftlite.config.parsing import build
    given = {k: v for k, v in values.items() if not (isinstance(v, str) and not v.strip())}
    args = build(MergeArguments, {"ckpt_dir": (ckpt_dir or "").strip() or None, **given},
                 where="export")
    problems = []
    try:
        args.validate()
    except UsageError as e:
        problems += [x.strip()[2:] for x in str(e).splitlines()[1:]]
    if args.ckpt_dir and os.path.isdir(args.ckpt_dir) and not is_adapter(args.ckpt_dir):
        problems.append(f"--ckpt_dir {args.ckpt_dir}: no adapter_config.json, so not a LoRA "
                        "checkpoint (a merged model needs no merging)")
    problems += policy.merge_problems(args, output_of(args))
    if problems:
        raise UsageError("invalid arguments:\n  - " + "\n  - ".join(problems))
    return args


def output_of(args) -> str | None:
    """Where merge-lora writes (its documented default: <ckpt_dir>-merged)."""
    if args.output_dir:
        return args.output_dir
    return os.path.normpath(args.ckpt_dir) + "-merged" if args.ckpt_dir else None


def build(manager, policy) -> None:
    root = manager.root
    with gr.Tab("Export", id="export", elem_id="tab-export"):
        gr.Markdown("Merge a LoRA checkpoint into a plain transformers model "
                    "(`swiftlite merge-lora`).")
        ckpt = checkpoint_picker("export", "a LoRA checkpoint folder (adapter_config.json "
                                 "inside)", root)
        fields = merge_fields()
        widgets = field_widgets(fields, "export")
        merge_btn = gr.Button("Merge", variant="primary", elem_id="export-merge")
        result = gr.HTML(elem_id="export-result")
        log = command_log("export", "merge log")

    def merge(ckpt_dir, *values):
        try:
            args = merge_args(ckpt_dir, {f.name: v for f, v in zip(fields, values)}, policy)
        except SwiftliteError as e:
            yield errors_html(e), ""
            return
        argv = ["merge-lora", *form.command_argv(args)]
        yield "<div>Merging...</div>", ""
        for text, rc in run_child(argv):
            yield gr.skip(), text
        if rc != 0:
            yield (f"<div class='form-error'><b>merge-lora failed</b> (exit code {rc}); see the "
                   "log below.</div>", text)
            return
        yield (f"<div class='form-ok'>Merged model: <code id='export-folder'>"
               f"{html.escape(output_of(args))}</code></div>", text)

    merge_btn.click(merge, [ckpt, *widgets], [result, log])
