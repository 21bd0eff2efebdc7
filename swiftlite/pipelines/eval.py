"""`swiftlite eval`: did the fine-tuning help? A model or checkpoint scored on evaluation sets.

  chat sets             answers generated (the engine of `infer`), scored against the last
                        assistant message: ROUGE, BLEU-4, exact match, stopped, tool calls;
                        and the references' loss with the training encoding
  multiple-choice sets  the likeliest option letter after the model's chat template: accuracy

Every set is read and checked before a model loads. Writes OUTPUT/metrics.json and
OUTPUT/predictions.jsonl, prints a table; --compare evaluates a second model on the same rows
(its predictions in predictions-compare.jsonl, both in compare.png).
"""
from __future__ import annotations

import json
import os
import random
import time

from swiftlite.config.eval_args import EvalArguments
from swiftlite.config.parsing import build
from swiftlite.log import info
from swiftlite.runtime.atomic import write_json, write_lines


# -- reading the sets ------------------------------------------------------------------------
def read_sets(args: EvalArguments) -> dict[str, dict]:
    """name -> {"kind": "chat" | "choice", "rows": [...], "shots": [...]} for every
    --eval_dataset, each checked (a UsageError naming file:line on bad rows)."""
    from swiftlite.data import load_conversations, parse_spec
    from swiftlite.data.files import read_rows
    from swiftlite.errors import UsageError
    from swiftlite.evaluation import choice
    sets = {}
    for spec, name in zip(args.eval_dataset, _set_names(args.eval_dataset)):
        path, n = parse_spec(spec)
        raw = read_rows(path) if os.path.isfile(path) else []
        if raw and choice.is_choice_file(raw[0][1]):
            items = choice.check_rows(raw, path)
            shots, items = items[:args.n_shot], items[args.n_shot:]
            if not items:
                raise UsageError(f"{path}: no questions left to score after --n_shot "
                                 f"{args.n_shot} examples.")
            if n is not None and n < len(items):
                items = random.Random(args.seed or 0).sample(items, n)
            sets[name] = {"kind": "choice", "rows": items, "shots": shots}
        else:
            convs, report = load_conversations([spec], require_reply=True,
                                               skip_bad_rows=args.skip_bad_rows,
                                               seed=args.seed if args.seed is not None else 42)
            sets[name] = {"kind": "chat", "rows": convs}
            info(f"{spec}: {report.summary()}")
    return sets


def _check_prompts(sets: dict[str, dict], args: EvalArguments) -> None:
    """Every chat row's prompt through the template of each model that will answer it, before
    any model loads: a row a template cannot render (tools for a model without tool syntax) is
    named by file:line, rather than stopping the run once a model has loaded."""
    from swiftlite.data.template import TemplateRejected
    from swiftlite.errors import UsageError
    from swiftlite.inference.checkpoints import TEMPLATE_FIELDS, describe, training_template
    chat = [c for s in sets.values() if s["kind"] == "chat" for c in s["rows"]]
    if not chat:
        return
    asked = {k: getattr(args, k) for k in TEMPLATE_FIELDS if getattr(args, k, None) is not None}
    targets = [(label_of(args), describe(args.ckpt_dir, args.model, **asked))]
    if args.compare:  # it keeps its own template
        where = (args.compare, None) if os.path.isdir(args.compare) else (None, args.compare)
        targets.append((args.compare, describe(*where)))
    for label, ckpt in targets:
        _, template = training_template(ckpt, args.trust_remote_code)
        bad = []
        for c in chat:
            try:
                template.check_renderable(c["messages"][:-1], c.get("tools"))
                template.render_prompt(c["messages"][:-1], tools=c.get("tools"))
            except TemplateRejected as e:
                bad.append(f"{c['where']}: {e}")
        if bad:
            more = f"\n  ... and {len(bad) - 5} more" if len(bad) > 5 else ""
            raise UsageError(f"{len(bad)} row(s) that {template.describe()} of {label} cannot "
                             "ask:\n  " + "\n  ".join(bad[:5]) + more)


def _set_names(specs: list[str]) -> list[str]:
    """Each set's name: its file name (with #N), or the spec as given where two would share
    one (a/test.jsonl, b/test.jsonl)."""
    from swiftlite.errors import UsageError
    twice = sorted({s for s in specs if specs.count(s) > 1})
    if twice:
        raise UsageError(f"--eval_dataset {' '.join(twice)}: given twice")
    names = [os.path.basename(s) for s in specs]
    return [s if names.count(n) > 1 else n for s, n in zip(specs, names)]


# -- scoring one model -----------------------------------------------------------------------
def score_chat(engine, convs: list[dict], answers: list, args: EvalArguments) -> list[dict]:
    """Each row with its answer, scores and (--eval_loss, which needs engine.model) loss."""
    from swiftlite.evaluation.metrics import text_scores, tool_call_scores
    rows = []
    for c, a in zip(convs, answers):
        ref = c["messages"][-1]
        row = {"messages": c["messages"][:-1], "reference": ref.get("content") or "",
               "response": a.text, "finish_reason": a.finish_reason, "tokens": a.tokens}
        # What is scored is the reply's text alone: without its reasoning (Qwen3's think
        # block, empty or not) and, on rows that offer tools, without its calls.
        reply = engine.parse(a.text)
        row["content"] = reply["content"]
        if c.get("tools"):
            row["tools"] = c["tools"]
            row["tool_calls"] = reply["tool_calls"]
            row["reference_tool_calls"] = ref.get("tool_calls") or []
            row.update(tool_call_scores(reply["tool_calls"], ref.get("tool_calls")))
        rows.append(row)
    text = [r for r in rows if r["reference"].strip()]  # a reply that only calls tools has none
    per_row = text_scores([r["content"] for r in text],
                          [r["reference"] for r in text])
    for r, s in zip(text, per_row):
        r.update(s)
    if args.eval_loss:
        from swiftlite.evaluation.scoring import reply_losses
        losses = reply_losses(engine.model, engine.template, engine.device, convs,
                              args.max_batch_size)
        for r, (nll, n) in zip(rows, losses):
            r["nll"], r["loss_tokens"] = nll, n
    return rows


def generate(engine, sets: dict[str, dict], args: EvalArguments) -> dict[str, list]:
    """Every chat set's answers, in its rows' order."""
    out = {}
    for name, s in sets.items():
        if s["kind"] != "chat":
            continue
        t0 = time.time()
        prompts = [{"messages": c["messages"][:-1], "tools": c.get("tools")} for c in s["rows"]]
        out[name] = engine.answer_batch(prompts, max_batch_size=args.max_batch_size,
                                        progress=True, **args.generation_kwargs())
        took = max(time.time() - t0, 1e-9)
        info(f"{name}: {len(prompts)} answers generated in {took:.1f} s "
             f"({len(prompts) / took:.2f} rows/s, {args.infer_backend})")
    return out


def score_model(sets: dict[str, dict], args: EvalArguments, out: str,
                target: str | None = None, dtype: str | None = None):
    """(rows per set, the model's dtype). Answers come from the pt engine or, with
    --infer_backend vllm, from vLLM's server; loss and multiple choice are forward passes, so
    they stay with transformers (loaded after vLLM is gone, and only when a set needs them)."""
    from swiftlite.evaluation import choice
    chat = any(s["kind"] == "chat" for s in sets.values())
    answers, engine = {}, None
    if args.infer_backend == "vllm" and chat:
        engine = _start_vllm(args, out, target)
        try:
            answers = generate(engine, sets, args)
        finally:
            engine.unload()
    if any(s["kind"] == "choice" for s in sets.values()) or (chat and (
            args.eval_loss or args.infer_backend == "pt")):
        engine = _load(args, target, dtype)
    if not answers:
        answers = generate(engine, sets, args)
    rows = {}
    for name, s in sets.items():
        t0 = time.time()
        if s["kind"] == "choice":
            rows[name] = choice.score(engine.model, engine.template, engine.device, s["rows"],
                                      s["shots"], args.max_batch_size)
            took = max(time.time() - t0, 1e-9)
            info(f"{name}: {len(s['rows'])} questions scored in {took:.1f} s "
                 f"({len(s['rows']) / took:.2f} rows/s)")
        else:
            rows[name] = score_chat(engine, s["rows"], answers[name], args)
        for r in rows[name]:
            r["dataset"] = name
    dtype = engine.dtype
    engine.unload()
    return rows, dtype


def _start_vllm(args: EvalArguments, out: str, target: str | None):
    from swiftlite.inference.engine import engine_overrides
    from swiftlite.inference.vllm_engine import VllmEngine
    overrides = engine_overrides(args)
    log = os.path.join(out, "vllm.log" if target is None else "vllm-compare.log")
    if target is None:
        return VllmEngine.start(args.ckpt_dir, args.model, args, log, **overrides)
    from swiftlite.inference.checkpoints import TEMPLATE_FIELDS
    for k in TEMPLATE_FIELDS:  # the compared model keeps its own
        overrides.pop(k, None)
    return VllmEngine.start(*((target, None) if os.path.isdir(target) else (None, target)),
                            args, log, **overrides)


def _check_vllm_can_serve(args: EvalArguments) -> None:
    """deploy's pre-flight, before anything is written or started: an adapter (evaluated or
    compared) that vLLM cannot serve as LoRA is refused with the way out."""
    from swiftlite.inference.checkpoints import describe
    from swiftlite.inference.server.vllm_lora import check_adapters
    for name, ckpt_dir, model in (("evaluated", args.ckpt_dir, args.model),
                                  ("--compare", args.compare, None)):
        if ckpt_dir and os.path.isdir(ckpt_dir):
            ckpt = describe(ckpt_dir, model)
            if ckpt.kind == "adapter":
                check_adapters({name: ckpt.path})


def _write_rows(path: str, rows_per_set: dict[str, list[dict]]) -> None:
    write_lines(path, (json.dumps(r, ensure_ascii=False) for rows in rows_per_set.values()
                       for r in rows))


def _load(args: EvalArguments, target: str | None = None, dtype: str | None = None):
    """The engine of the evaluated model, or of --compare's (a folder: a checkpoint or model
    folder; otherwise a model id or alias) in the first one's dtype unless --torch_dtype says."""
    from swiftlite.inference.engine import InferEngine, engine_overrides
    overrides = engine_overrides(args)
    if target is None:
        return InferEngine.load(args.ckpt_dir, args.model, **overrides)
    overrides.pop("template", None)  # the compared model keeps its own template and system
    overrides.pop("system", None)
    if args.torch_dtype == "auto" and dtype:
        overrides["torch_dtype"] = dtype
    if os.path.isdir(target):
        return InferEngine.load(target, None, **overrides)
    return InferEngine.load(None, target, **overrides)


COMPARE_FILES = ("predictions-compare.jsonl", "compare.png", "vllm-compare.log")


def _check_compare(target: str) -> None:
    """--compare's model or checkpoint, checked before anything is read or loaded (a typo
    found after the first model's whole evaluation would lose it)."""
    from swiftlite.errors import UsageError
    from swiftlite.models.registry import check_model_name
    if os.path.isdir(target):
        if not any(os.path.isfile(os.path.join(target, f))
                   for f in ("adapter_config.json", "config.json")):
            raise UsageError(f"--compare {target}: neither a LoRA checkpoint (adapter_config.json) "
                             "nor a model folder (config.json)")
        return
    check_model_name(target, flag="--compare")


def label_of(args: EvalArguments) -> str:
    return args.ckpt_dir or args.model


# -- the command -----------------------------------------------------------------------------
def run(args: EvalArguments) -> dict:
    from swiftlite.evaluation import report
    args.validate()
    if args.compare:
        _check_compare(args.compare)
    sets = read_sets(args)  # bad data is reported before any model loads
    _check_prompts(sets, args)
    if args.infer_backend == "vllm":
        _check_vllm_can_serve(args)
    out = os.path.abspath(args.output_dir or os.path.join(
        args.ckpt_dir or "output", "eval", time.strftime("%Y%m%d-%H%M%S")))
    os.makedirs(out, exist_ok=True)
    for stale in COMPARE_FILES:  # an earlier run's comparison would contradict this one
        if os.path.exists(os.path.join(out, stale)):
            os.remove(os.path.join(out, stale))
    rows, dtype = score_model(sets, args, out)
    metrics = report.metrics_of(rows, label_of(args))
    _write_rows(os.path.join(out, "predictions.jsonl"), rows)
    write_json(os.path.join(out, "metrics.json"), metrics, indent=2)  # kept if --compare fails
    other = None
    if args.compare:
        other_rows, _ = score_model(sets, args, out, args.compare, dtype)
        other = report.metrics_of(other_rows, args.compare)
        _write_rows(os.path.join(out, "predictions-compare.jsonl"), other_rows)
        metrics["compare"] = other
        report.chart(os.path.join(out, "compare.png"), metrics, other)
    write_json(os.path.join(out, "metrics.json"), metrics, indent=2)
    print(report.table(metrics, other), flush=True)
    info(f"metrics, predictions{' and compare.png' if other else ''} in {out}")
    metrics["output_dir"] = out
    return metrics


def eval(args: EvalArguments | dict | None = None, **kwargs) -> dict:  # noqa: A001
    """Python API: swiftlite.eval(ckpt_dir=..., eval_dataset=["qa.jsonl"]) -> the metrics (as in
    metrics.json, plus "output_dir")."""
    if args is None or isinstance(args, dict):
        args = build(EvalArguments, {**(args or {}), **kwargs}, where="swiftlite.eval")
    return run(args)


def main(argv: list[str]) -> None:
    from swiftlite.config.argv import parse_argv
    args = parse_argv(EvalArguments, argv, "swiftlite eval",
                      "Score a model or checkpoint on chat sets (generated answers: ROUGE, "
                      "BLEU-4, exact match, stopped, tool calls, loss) and multiple-choice sets "
                      "(accuracy); --compare another model on the same rows.")
    run(args)
