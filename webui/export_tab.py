"""The Export tab: merge a LoRA checkpoint into a plain model with `swiftlite merge-lora`, run as
a child process (the merge loads a full model; the Web-UI process stays small), log streamed."""
from __future__ import annotations

import html
import os
import subprocess
import sys

import gradio as gr

from .choices import adapter_checkpoints, is_adapter, labelled
from .form import inside


def merge_command(ckpt_dir: str, output_dir: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "swiftlite.cli", "merge-lora", "--ckpt_dir", ckpt_dir]
    return cmd + (["--output_dir", output_dir] if output_dir else [])


def default_output(ckpt_dir: str) -> str:
    return os.path.normpath(ckpt_dir) + "-merged"


def build(manager) -> None:
    root = manager.root
    with gr.Tab("Export", id="export", elem_id="tab-export"):
        gr.Markdown("Merge a LoRA checkpoint into a plain transformers model "
                    "(`swiftlite merge-lora --ckpt_dir ...`).")
        with gr.Row():
            ckpt = gr.Dropdown(label="ckpt_dir", choices=[], allow_custom_value=True,
                               info="a LoRA checkpoint folder (adapter_config.json inside)",
                               elem_id="export-ckpt", scale=4)
            rescan = gr.Button("Refresh list", elem_id="export-rescan", scale=1)
        out = gr.Textbox(label="output_dir", max_lines=1, elem_id="export-output",
                         info=f"where the merged model goes, inside {root}; default: "
                              "<ckpt_dir>-merged")
        merge_btn = gr.Button("Merge", variant="primary", elem_id="export-merge")
        result = gr.HTML(elem_id="export-result")
        log = gr.Textbox(label="merge log", lines=12, max_lines=12, autoscroll=True,
                         interactive=False, elem_id="export-log")

    def scan():
        return gr.update(choices=labelled(root, adapter_checkpoints(root)))

    def merge(ckpt_dir, output_dir):
        ckpt_dir, output_dir = (ckpt_dir or "").strip(), (output_dir or "").strip()
        problems = []
        if not ckpt_dir:
            problems.append("choose a checkpoint (ckpt_dir)")
        elif not os.path.isdir(ckpt_dir):
            problems.append(f"--ckpt_dir {ckpt_dir}: no such folder")
        elif not is_adapter(ckpt_dir):
            problems.append(f"--ckpt_dir {ckpt_dir}: no adapter_config.json, so not a LoRA "
                            "checkpoint (merged models need no merging)")
        target = output_dir or (default_output(ckpt_dir) if ckpt_dir else "")
        if target and not inside(target, root):
            problems.append(f"--output_dir {target}: must be inside the output root {root}")
        if problems:
            yield ("<div class='form-error'><b>Cannot merge:</b><ul>" + "".join(
                f"<li>{html.escape(p)}</li>" for p in problems) + "</ul></div>", "")
            return
        cmd = merge_command(ckpt_dir, output_dir or None)
        text = "$ swiftlite merge-lora " + " ".join(cmd[4:]) + "\n"
        yield "<div>Merging...</div>", text
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, stdin=subprocess.DEVNULL)
        for line in proc.stdout:
            text += line
            yield gr.skip(), text
        rc = proc.wait()
        if rc != 0:
            yield (f"<div class='form-error'><b>merge-lora failed</b> (exit code {rc}); see the "
                   "log.</div>", text)
            return
        yield (f"<div class='form-ok'>Merged model: <code id='export-folder'>"
               f"{html.escape(target)}</code></div>", text)

    rescan.click(scan, None, ckpt)
    merge_btn.click(merge, [ckpt, out], [result, log])
    ckpt.focus(scan, None, ckpt)  # a fresh list whenever the user opens it
