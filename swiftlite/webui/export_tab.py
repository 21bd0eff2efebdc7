"""The Export tab: merge a LoRA checkpoint into a plain model with `swiftlite merge-lora`, or
export it to GGUF with `swiftlite export` (format and quant type), run as a child process (the
merge loads a full model; the Web-UI process stays small), log streamed. The merge fields are
MergeArguments' (the CLI's flags), like the Train form is SftArguments'."""
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


def gguf_args(ckpt_dir: str, fmt: str, quant: str, policy):
    """The GGUF export's ExportArguments (default output: <ckpt_dir>-gguf); one UsageError."""
    from swiftlite.config.export_args import ExportArguments
    from swiftlite.config.parsing import build
    args = build(ExportArguments, {"ckpt_dir": (ckpt_dir or "").strip() or None, "format": fmt,
                                   "quant": quant}, where="export")
    problems = []
    try:
        args.validate()
    except UsageError as e:
        problems += [x.strip()[2:] for x in str(e).splitlines()[1:]]
    target = os.path.normpath(args.ckpt_dir) + "-gguf" if args.ckpt_dir else None
    problems += policy.merge_problems(args, target, suffix="-gguf")
    if problems:
        raise UsageError("invalid arguments:\n  - " + "\n  - ".join(problems))
    return args, target


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
        gr.Markdown("Or export it to GGUF for llama.cpp, LM Studio and Ollama (`swiftlite "
                    "export`: the training template and end-of-turn token go into the file, an "
                    "Ollama Modelfile beside it; needs `bash scripts/setup_llamacpp.sh`).")
        from swiftlite.config.export_args import FORMATS, QUANTS
        with gr.Row():
            gguf_format = gr.Dropdown(list(FORMATS), value="gguf", label="format",
                                      elem_id="export-format")
            gguf_quant = gr.Dropdown(list(QUANTS), value="q4_k_m", label="quant",
                                     elem_id="export-quant")
        gguf_btn = gr.Button("Export GGUF", elem_id="export-gguf")
        result = gr.HTML(elem_id="export-result")
        log = command_log("export", "log (merge-lora or export)")

    def run(command, argv, doing, done, folder):
        """The child's log as it runs, then where its output is (or that it failed)."""
        yield f"<div>{doing}...</div>", ""
        for text, rc in run_child([command, *argv]):
            yield gr.skip(), text
        if rc != 0:
            yield (f"<div class='form-error'><b>{command} failed</b> (exit code {rc}); see the "
                   "log below.</div>", text)
            return
        yield (f"<div class='form-ok'>{done}: <code id='export-folder'>"
               f"{html.escape(folder)}</code></div>", text)

    def merge(ckpt_dir, *values):
        try:
            args = merge_args(ckpt_dir, {f.name: v for f, v in zip(fields, values)}, policy)
        except SwiftliteError as e:
            yield errors_html(e), ""
            return
        yield from run("merge-lora", form.command_argv(args), "Merging", "Merged model",
                       output_of(args))

    merge_btn.click(merge, [ckpt, *widgets], [result, log])

    def export_gguf(ckpt_dir, fmt, quant):
        try:
            args, target = gguf_args(ckpt_dir, fmt, quant, policy)
        except SwiftliteError as e:
            yield errors_html(e), ""
            return
        yield from run("export", form.command_argv(args), "Exporting", "GGUF and Modelfile",
                       target)

    gguf_btn.click(export_gguf, [ckpt, gguf_format, gguf_quant], [result, log])
