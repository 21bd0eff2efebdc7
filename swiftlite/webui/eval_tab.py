"""The Eval tab: `swiftlite eval` on a checkpoint, run as a child process, log streamed; then
its figures as a table (with --compare's beside them) and the comparison chart."""
from __future__ import annotations

import dataclasses
import html
import json
import os
import time

import gradio as gr

from swiftlite.errors import SwiftliteError, UsageError
from swiftlite.webui import form
from swiftlite.webui.widgets import checkpoint_picker, command_log, errors_html, field_widgets, run_child

# The flags offered (the rest keep the CLI's defaults).
OFFERED = ("eval_dataset", "compare", "max_new_tokens", "max_batch_size", "n_shot",
           "eval_loss", "torch_dtype", "output_dir")


def eval_fields():
    from swiftlite.config.eval_args import EvalArguments
    by_name = {f.name: f for f in dataclasses.fields(EvalArguments)}
    return [by_name[n] for n in OFFERED]


def eval_args(ckpt_dir: str, values: dict, policy):
    """Widget values -> validated EvalArguments with an output folder inside the output root;
    typed paths checked; one UsageError."""
    from swiftlite.config.eval_args import EvalArguments
    from swiftlite.config.parsing import build
    given = {k: v for k, v in values.items() if not (isinstance(v, str) and not v.strip())}
    if isinstance(given.get("eval_dataset"), str):
        given["eval_dataset"] = given["eval_dataset"].split()
    args = build(EvalArguments, {"ckpt_dir": (ckpt_dir or "").strip() or None, **given},
                 where="eval")
    if not args.output_dir and args.ckpt_dir:
        args.output_dir = os.path.join(args.ckpt_dir, "eval", time.strftime("%Y%m%d-%H%M%S"))
    problems = []
    try:
        args.validate()
    except UsageError as e:
        problems += [x.strip()[2:] for x in str(e).splitlines()[1:]]
    if args.ckpt_dir:  # and what the folder would load: its base model, code
        outside = policy.path_problems("--ckpt_dir", args.ckpt_dir)
        problems += outside or (policy.trained_problems(args.ckpt_dir)
                                if os.path.isdir(args.ckpt_dir) else [])
    for path in args.eval_dataset:
        problems += policy.path_problems("--eval_dataset", path.split("#")[0])
    if args.compare:
        problems += policy.infer_problems(args.compare, "--compare")
    if args.output_dir and not policy.inside(args.output_dir, [os.path.realpath(policy.root)]):
        problems.append(f"--output_dir {args.output_dir}: must be inside the output root "
                        f"{policy.root}")
    if problems:
        raise UsageError("invalid arguments:\n  - " + "\n  - ".join(problems))
    return args


def metrics_html(metrics: dict) -> str:
    """The overall figures of metrics.json as a table (and --compare's, with the difference)."""
    from swiftlite.evaluation.report import SHOWN, short_label
    other = metrics.get("compare")
    head = "<tr><th>metric</th><th>" + html.escape(short_label(metrics["model"])) + "</th>" + (
        f"<th>{html.escape(short_label(other['model']))}</th><th>difference</th>" if other
        else "") + "</tr>"
    rows = []
    for key, (label, digits) in SHOWN.items():
        if key not in metrics["overall"]:
            continue
        a = metrics["overall"][key]
        cells = f"<td>{label}</td><td>{a:.{digits}f}</td>"
        if other and key in other["overall"]:
            b = other["overall"][key]
            cells += f"<td>{b:.{digits}f}</td><td>{a - b:+.{digits}f}</td>"
        rows.append(f"<tr data-metric='{key}'>{cells}</tr>")
    return f"<table id='eval-metrics'>{head}{''.join(rows)}</table>"


def build(manager, policy) -> None:
    root = manager.root
    with gr.Tab("Eval", id="eval", elem_id="tab-eval"):
        gr.Markdown("Score a checkpoint on evaluation sets (`swiftlite eval`): chat rows get "
                    "answers scored by ROUGE, BLEU-4, exact match and tool calls; "
                    "question/A/B/.../answer files are multiple choice. `compare`: the base "
                    "model, side by side.")
        ckpt = checkpoint_picker("eval", "a LoRA checkpoint (or merged model) folder", root)
        fields = eval_fields()
        widgets = field_widgets(fields, "eval")
        run_btn = gr.Button("Evaluate", variant="primary", elem_id="eval-run")
        result = gr.HTML(elem_id="eval-result")
        chart = gr.Image(label="comparison", type="filepath", visible=False,
                         elem_id="eval-chart")
        log = command_log("eval", "eval log")

    def evaluate(ckpt_dir, *values):
        try:
            args = eval_args(ckpt_dir, {f.name: v for f, v in zip(fields, values)}, policy)
        except SwiftliteError as e:
            yield errors_html(e), gr.update(visible=False), ""
            return
        yield "<div>Evaluating...</div>", gr.update(visible=False), ""
        for text, rc in run_child(["eval", *form.command_argv(args)]):
            yield gr.skip(), gr.skip(), text
        path = os.path.join(args.output_dir, "metrics.json")
        if rc != 0 or not os.path.exists(path):
            yield (f"<div class='form-error'><b>eval failed</b> (exit code {rc}); see the log "
                   "below.</div>", gr.update(visible=False), text)
            return
        with open(path, encoding="utf-8") as f:
            metrics = json.load(f)
        png = os.path.join(args.output_dir, "compare.png")
        yield (metrics_html(metrics) + f"<div class='form-ok'>Figures and predictions in "
               f"<code id='eval-folder'>{html.escape(args.output_dir)}</code></div>",
               gr.update(value=png, visible=True) if os.path.exists(png)
               else gr.update(visible=False), text)

    run_btn.click(evaluate, [ckpt, *widgets], [result, chart, log])
