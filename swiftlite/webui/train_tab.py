"""The Train tab: the form generated from SftArguments, Preview / Start / Stop, and the runs
list with the selected run's live log and loss curve (polled from disk by a gr.Timer)."""
from __future__ import annotations

import filecmp
import html
import os
import shlex
import shutil
import time

import gradio as gr

from swiftlite.data.json_template import template_names
from swiftlite.errors import SwiftliteError, UsageError
from swiftlite.training.deepspeed import preset_names

from swiftlite.webui import form
from swiftlite.webui.runs import LOG_FILE, RunManager, describe, find_runs, loss_rows

POLL_S = 2.0
# Keep the log scrolled to its end while it grows, unless the user scrolled up to read.
_PIN_JS = """(...inputs) => { const t = document.querySelector('#run-log textarea');
  window.__swiftlitePin = !t || t.scrollTop === 0 ||
    t.scrollTop + t.clientHeight >= t.scrollHeight - 30; return inputs; }"""
_SCROLL_JS = """() => { setTimeout(() => { const t = document.querySelector('#run-log textarea');
  if (t && window.__swiftlitePin !== false) t.scrollTop = t.scrollHeight; }, 50); }"""
LOG_TAIL_BYTES = 20_000
RUN_COLUMNS = ["run", "status", "step", "loss", "checkpoints", "started"]


def _widget(f, root: str):
    """One input widget per SftArguments field: label = flag name, info = the CLI's help."""
    name, k, d = f.name, form.kind(f), form.default(f)
    common = dict(label=form.label(f), info=form.info(f), elem_id=f"train-{name}")
    if name == "output_dir":
        common["info"] = f"a folder inside {root}; the run goes to <output_dir>/v<N>-<timestamp>"
    if name == "model":
        from swiftlite.models.registry import MODELS
        return gr.Dropdown(choices=list(MODELS), value=None, allow_custom_value=True, **common)
    if name == "template":
        return gr.Dropdown(choices=[("auto (the model's own)", "")] + template_names(), value="",
                           allow_custom_value=True, **common)
    if name == "deepspeed":  # the shipped presets, or a JSON file typed in
        return gr.Dropdown(choices=[("off", "")] + preset_names() + ["auto"], value="",
                           allow_custom_value=True, **common)
    if k == "bool":
        return gr.Checkbox(value=bool(d), **common)
    if k == "choice":
        return gr.Dropdown(choices=list(f.metadata["choices"]), value=d, **common)
    return gr.Textbox(value=form.widget_value(f, d), max_lines=1,
                      placeholder=f"{root}/<model>" if name == "output_dir" else None, **common)


def keep_upload(src: str, root: str) -> str:
    """Copy an uploaded file into <root>/uploads (gradio's temporary copy does not last), under
    its own name, or name-1, name-2, ... when a different file already has it."""
    dest = os.path.join(root, "uploads")
    os.makedirs(dest, exist_ok=True)
    stem, ext = os.path.splitext(os.path.basename(src))
    target, n = os.path.join(dest, stem + ext), 0
    while os.path.exists(target) and not filecmp.cmp(src, target, shallow=False):
        n += 1
        target = os.path.join(dest, f"{stem}-{n}{ext}")
    shutil.copyfile(src, target)
    return target


def _error_md(e: Exception) -> str:
    """A UsageError as a list next to the form ('invalid arguments:' + '  - item' lines)."""
    lines = str(e).splitlines()
    items = [x.strip()[2:] if x.strip().startswith("- ") else x.strip() for x in lines[1:]]
    body = "".join(f"<li>{html.escape(x)}</li>" for x in items if x)
    head = html.escape(lines[0] if lines else str(e))
    return f"<div class='form-error'><b>Please fix:</b> {head}<ul>{body}</ul></div>"


def _table(root: str, runs: list) -> list[list]:
    return [[os.path.relpath(r.path, root), r.status,
             f"{r.step}/{r.max_steps}" if r.step is not None else "",
             f"{r.loss:.4f}" if r.loss is not None else "",
             " ".join(os.path.basename(c) for c in r.checkpoints),
             time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.started)) if r.started else ""]
            for r in runs]


def _log_tail(run_dir: str) -> str:
    for name in (LOG_FILE,):
        path = os.path.join(run_dir, name)
        if os.path.exists(path):
            with open(path, "rb") as f:
                f.seek(max(0, os.path.getsize(path) - LOG_TAIL_BYTES))
                return f.read().decode("utf-8", "replace")
    return "(no Web-UI log: this run was started from the command line)"


def _loss_frame(run_dir: str | None):
    import pandas as pd
    rows = loss_rows(run_dir) if run_dir else []
    return pd.DataFrame({"step": [r["step"] for r in rows], "loss": [r["loss"] for r in rows]})


def build(manager: RunManager, policy) -> dict:
    """Lay out the tab inside the current gr.Blocks; returns the components other tabs use."""
    root = manager.root
    widgets = {}
    with gr.Tab("Train", id="train", elem_id="tab-train"):
        gr.Markdown("Fine-tune with `swiftlite sft`, or align with `swiftlite rlhf` (a "
                    "preference stage: the rlhf arguments below apply). Every field is the CLI "
                    "flag of the same name; empty fields take the CLI default.")
        stage = gr.Radio(list(form.STAGES), value="SFT", label="stage", elem_id="train-stage",
                         info="SFT: swiftlite sft; DPO / ORPO / SimPO / CPO / KTO: swiftlite "
                              "rlhf --rlhf_type (preference pairs; KTO: labelled rows)")
        for group in form.GROUP_ORDER:  # the fields up front, laid out by group
            primary = [form.FIELDS[n] for n in form.PRIMARY
                       if n in form.FIELDS and form.FIELDS[n].metadata.get("group") == group]
            for i in range(0, len(primary), 4):
                with gr.Row():
                    for f in primary[i:i + 4]:
                        widgets[f.name] = _widget(f, root)
        with gr.Row():
            nproc = gr.Textbox(value="1", label="processes (NPROC_PER_NODE)", max_lines=1,
                               info="processes per node; more than 1 runs under torchrun",
                               elem_id="train-nproc")
            upload = gr.File(label="upload dataset files (stored in the output root, added to "
                             "dataset)", file_count="multiple", height=150,
                             file_types=[".jsonl", ".json", ".csv", ".parquet"],
                             elem_id="train-upload")
        for group in form.GROUP_ORDER:
            rest = [f for f in form.fields() if f.metadata.get("group") == group
                    and f.name not in form.PRIMARY]
            if not rest:
                continue
            with gr.Accordion(f"more {group} arguments", open=False):
                for i in range(0, len(rest), 3):
                    with gr.Row():
                        for f in rest[i:i + 3]:
                            widgets[f.name] = _widget(f, root)
        extra = gr.Textbox(label="extra arguments", max_lines=1, elem_id="train-extra",
                           info="any other transformers TrainingArguments field, as on the "
                                "CLI: --report_to none --eval_strategy no")
        with gr.Row():
            preview_btn = gr.Button("Preview command", elem_id="train-preview")
            start_btn = gr.Button("Start", variant="primary", elem_id="train-start")
            stop_btn = gr.Button("Stop", variant="stop", elem_id="train-stop")
        message = gr.HTML(elem_id="train-message")
        command = gr.Code(label="command", language="shell", interactive=False, lines=3,
                          elem_id="train-command")

        gr.Markdown("### Runs in " + root)
        runs_table = gr.Dataframe(headers=RUN_COLUMNS, interactive=False, elem_id="runs-table",
                                  value=[], wrap=True)
        # allow_custom_value: gradio checks a dropdown's value against the choices this session
        # last sent, so a poll already under way when Start (or a deleted run folder) changes
        # the list would fail with "not in the list of choices"; refresh() handles stale names.
        run_select = gr.Dropdown(label="run", choices=[], value=None, elem_id="run-select",
                                 allow_custom_value=True,
                                 info="the run whose log and loss curve are shown below")
        run_status = gr.Markdown(elem_id="run-status")
        with gr.Row(equal_height=False):
            log = gr.Textbox(label="log", lines=18, max_lines=18, autoscroll=True,
                             interactive=False, elem_id="run-log")
            plot = gr.LinePlot(_loss_frame(None), x="step", y="loss", title="training loss",
                               height=360, elem_id="run-plot")
        timer = gr.Timer(POLL_S)
        # Inside the Tab: a component left directly under gr.Tabs becomes a phantom tab.
        known = gr.State(None)  # the run list this page shows

    names = list(widgets)
    inputs = [widgets[n] for n in names] + [stage, nproc, extra]

    def _args(*vals):
        raw = dict(zip(names, vals[:len(names)]))
        try:
            n = int(str(vals[-2]).strip() or 1)
            if n < 1:
                raise ValueError
        except ValueError:
            raise UsageError(f"processes: expected a whole number of at least 1, got "
                             f"{vals[-2]!r}") from None
        return form.to_args(raw, vals[-1], policy=policy, stage=vals[-3]), n

    def on_preview(*vals):
        try:
            args, n = _args(*vals)
        except SwiftliteError as e:
            return _error_md(e), ""
        except Exception as e:  # a bug, not a user mistake: still say so next to the form
            return _error_md(RuntimeError(f"{type(e).__name__}: {e}")), ""
        return "", form.preview(args, n)

    def on_start(*vals):
        try:
            args, n = _args(*vals)
            text = form.preview(args, n)
            run_dir = manager.start(form.command_argv(args), args.output_dir, n, text,
                                    command=form.command(args))
        except SwiftliteError as e:
            return _error_md(e), gr.skip(), gr.skip()
        except Exception as e:
            return _error_md(RuntimeError(f"{type(e).__name__}: {e}")), gr.skip(), gr.skip()
        rel = os.path.relpath(run_dir, root)
        rels = [os.path.relpath(p, root) for p in find_runs(root)]
        return (f"<div class='form-ok'>Started {html.escape(rel)}</div>", text,
                gr.update(choices=rels, value=rel))

    def on_stop(selected):
        if not selected:
            return "<div class='form-error'>Select a run to stop.</div>"
        try:
            manager.stop(os.path.join(root, selected))
        except SwiftliteError as e:
            return _error_md(e)
        return f"<div class='form-ok'>Stopping {html.escape(selected)}</div>"

    def on_upload(files, current):
        if not files:
            return gr.skip()
        paths = [keep_upload(f if isinstance(f, str) else f.name, root) for f in files]
        words = (current or "").strip()
        return (words + " " if words else "") + " ".join(shlex.quote(p) for p in paths)

    def refresh(selected, known=None):
        runs = [describe(p) for p in find_runs(root)]
        rels = [os.path.relpath(r.path, root) for r in runs]
        # Re-sending unchanged choices would close the list under a user who has it open.
        unchanged = known == rels and selected in rels
        if selected not in rels:  # none yet, or a run folder deleted since: show the newest
            selected = rels[0] if rels else None
        choices = gr.skip() if unchanged else gr.update(choices=rels, value=selected)
        run = next((r for r in runs if os.path.relpath(r.path, root) == selected), None)
        if run is None:
            return _table(root, runs), gr.update(choices=rels, value=None), \
                "No runs yet.", "", _loss_frame(None), rels
        status = (f"**{selected}**: <span class='run-state' data-state='{run.status}'>"
                  f"{run.status}</span>")
        if run.step is not None:
            status += f" · step {run.step}/{run.max_steps} · loss {run.loss:.4f}"
        status += f" · {len(loss_rows(run.path))} loss points"
        if run.checkpoints:
            status += " · checkpoints: " + ", ".join(os.path.basename(c)
                                                       for c in run.checkpoints)
        return (_table(root, runs), choices, status, _log_tail(run.path),
                _loss_frame(run.path), rels)

    refresh_inputs = [run_select, known]
    refresh_outputs = [runs_table, run_select, run_status, log, plot, known]
    preview_btn.click(on_preview, inputs, [message, command])
    start_btn.click(on_start, inputs, [message, command, run_select]).then(
        refresh, run_select, refresh_outputs)
    stop_btn.click(on_stop, run_select, message)
    upload.upload(on_upload, [upload, widgets["dataset"]], widgets["dataset"])
    timer.tick(refresh, refresh_inputs, refresh_outputs, show_progress="hidden",
               js=_PIN_JS).then(None, None, None, js=_SCROLL_JS)
    run_select.input(refresh, run_select, refresh_outputs)
    return {"refresh": refresh, "refresh_inputs": run_select, "refresh_outputs": refresh_outputs}
