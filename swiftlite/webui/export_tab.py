"""The Export tab: merge a LoRA checkpoint into a plain model with `swiftlite merge-lora`, run as
a child process (the merge loads a full model; the Web-UI process stays small), log streamed.
The fields are MergeArguments' (the CLI's flags), like the Train form is SftArguments'."""
from __future__ import annotations

import dataclasses
import html
import os
import shlex
import subprocess
import sys

import gradio as gr

from swiftlite.errors import SwiftliteError, UsageError

from swiftlite.webui import form
from swiftlite.webui.choices import adapter_checkpoints, is_adapter, labelled


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
        with gr.Row():
            ckpt = gr.Dropdown(label="ckpt_dir", choices=[], allow_custom_value=True,
                               info="a LoRA checkpoint folder (adapter_config.json inside)",
                               elem_id="export-ckpt", scale=4)
            rescan = gr.Button("Refresh list", elem_id="export-rescan", scale=1)
        widgets = []
        fields = merge_fields()
        for i in range(0, len(fields), 4):
            with gr.Row():
                for f in fields[i:i + 4]:
                    common = dict(label=f.name, info=form.info(f), elem_id=f"export-{f.name}")
                    d = form.default(f)
                    if form.kind(f) == "bool":
                        widgets.append(gr.Checkbox(value=bool(d), **common))
                    elif form.kind(f) == "choice":
                        widgets.append(gr.Dropdown(choices=list(f.metadata["choices"]),
                                                   value=d, **common))
                    else:
                        widgets.append(gr.Textbox(value=form.widget_value(f, d), max_lines=1,
                                                  **common))
        merge_btn = gr.Button("Merge", variant="primary", elem_id="export-merge")
        result = gr.HTML(elem_id="export-result")
        log = gr.Textbox(label="merge log", lines=12, max_lines=12, autoscroll=True,
                         interactive=False, elem_id="export-log")

    def scan():
        return gr.update(choices=labelled(root, adapter_checkpoints(root)))

    def merge(ckpt_dir, *values):
        try:
            args = merge_args(ckpt_dir, {f.name: v for f, v in zip(fields, values)}, policy)
        except SwiftliteError as e:
            items = [x.strip()[2:] for x in str(e).splitlines()[1:]] or [str(e)]
            yield ("<div class='form-error'><b>Please fix:</b><ul>" + "".join(
                f"<li>{html.escape(p)}</li>" for p in items) + "</ul></div>", "")
            return
        argv = ["merge-lora", *form.command_argv(args)]
        text = "$ swiftlite " + shlex.join(argv) + "\n"
        yield "<div>Merging...</div>", text
        proc = subprocess.Popen([sys.executable, "-m", "swiftlite.cli", *argv], text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        for line in proc.stdout:
            text += line
            yield gr.skip(), text
        rc = proc.wait()
        if rc != 0:
            yield (f"<div class='form-error'><b>merge-lora failed</b> (exit code {rc}); see the "
                   "log below.</div>", text)
            return
        yield (f"<div class='form-ok'>Merged model: <code id='export-folder'>"
               f"{html.escape(output_of(args))}</code></div>", text)

    rescan.click(scan, None, ckpt)
    ckpt.focus(scan, None, ckpt)  # a fresh list whenever the user opens it
    merge_btn.click(merge, [ckpt, *widgets], [result, log])
