"""Pieces the Web-UI's tabs share: a checkpoint picker, a widget per dataclass field, the
errors of a form, and a `swiftlite` command run as a child process with its log."""
from __future__ import annotations

import html
import shlex
import subprocess
import sys

import gradio as gr

from swiftlite.webui import form


def checkpoint_picker(prefix: str, info: str, root: str):
    """The ckpt_dir dropdown (elem_id PREFIX-ckpt) listing the adapter checkpoints under root,
    listed again when it is opened or its button (PREFIX-rescan) is pressed."""
    from swiftlite.webui.choices import adapter_checkpoints, labelled
    with gr.Row():
        ckpt = gr.Dropdown(label="ckpt_dir", choices=[], allow_custom_value=True, info=info,
                           elem_id=f"{prefix}-ckpt", scale=4)
        rescan = gr.Button("Refresh list", elem_id=f"{prefix}-rescan", scale=1)

    def scan():
        return gr.update(choices=labelled(root, adapter_checkpoints(root)))
    rescan.click(scan, None, ckpt)
    ckpt.focus(scan, None, ckpt)  # a fresh list whenever the user opens it
    return ckpt


def command_log(prefix: str, label: str):
    return gr.Textbox(label=label, lines=12, max_lines=12, autoscroll=True, interactive=False,
                      elem_id=f"{prefix}-log")


def run_child(argv: list[str]):
    """Runs `swiftlite ARGV` as a child process (a command that loads a model; the Web-UI
    process stays small): yields (the log so far, None) per line, then (the log, exit code).
    It gets only the environment it needs (runs.child_environ): not the Web-UI's login."""
    from swiftlite.webui.runs import child_environ
    text = "$ swiftlite " + shlex.join(argv) + "\n"
    proc = subprocess.Popen([sys.executable, "-m", "swiftlite.cli", *argv], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL,
                            env={**child_environ(), "PYTHONUNBUFFERED": "1"})
    for line in proc.stdout:
        text += line
        yield text, None
    yield text, proc.wait()


def errors_html(e: Exception) -> str:
    items = [x.strip()[2:] for x in str(e).splitlines()[1:]] or [str(e)]
    return ("<div class='form-error'><b>Please fix:</b><ul>" + "".join(
        f"<li>{html.escape(p)}</li>" for p in items) + "</ul></div>")


def field_widgets(fields, prefix: str) -> list:
    """A widget per dataclass field, four to a row (elem_id PREFIX-NAME)."""
    widgets = []
    for i in range(0, len(fields), 4):
        with gr.Row():
            for f in fields[i:i + 4]:
                common = dict(label=f.name, info=form.info(f), elem_id=f"{prefix}-{f.name}")
                d = form.default(f)
                if form.kind(f) == "bool":
                    widgets.append(gr.Checkbox(value=bool(d), **common))
                elif form.kind(f) == "choice":
                    widgets.append(gr.Dropdown(choices=list(f.metadata["choices"]), value=d,
                                               **common))
                else:
                    widgets.append(gr.Textbox(value=form.widget_value(f, d), max_lines=1,
                                              **common))
    return widgets
