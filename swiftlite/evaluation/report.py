"""An evaluation's figures from its scored rows: the summary per set and overall, the files
(metrics.json, predictions.jsonl, compare.png) and the table printed in the terminal."""
from __future__ import annotations

import math

from swiftlite.evaluation.metrics import ROUGE_TYPES

# metric -> (label in the table, digits); the order of the table's rows
SHOWN = {"rouge1": ("ROUGE-1", 2), "rouge2": ("ROUGE-2", 2), "rougeL": ("ROUGE-L", 2),
         "bleu4": ("BLEU-4", 2), "exact_match": ("exact match", 3), "stopped": ("stopped", 3),
         "mean_tokens": ("mean tokens", 1), "tool_call_accuracy": ("tool calls", 3),
         "tool_call_name_accuracy": ("tool names", 3), "accuracy": ("accuracy", 3),
         "loss": ("loss", 4), "perplexity": ("perplexity", 3), "rows": ("rows", 0)}


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def summarize(rows: list[dict]) -> dict:
    """The metrics of a list of scored rows (one set, or all of them)."""
    import sacrebleu
    from swiftlite.evaluation.metrics import bleu_texts
    out: dict = {"rows": len(rows)}
    text = [r for r in rows if "rouge1" in r]
    if text:
        out.update({k: _mean(text, k) for k in ROUGE_TYPES})
        hyps, refs = zip(*(bleu_texts(r.get("content", r["response"]), r["reference"])
                           for r in text))
        out["bleu4"] = sacrebleu.corpus_bleu(list(hyps), [list(refs)]).score
        out["exact_match"] = _mean(text, "exact_match")
    generated = [r for r in rows if "finish_reason" in r]
    if generated:
        out["stopped"] = sum(r["finish_reason"] == "stop" for r in generated) / len(generated)
        out["mean_tokens"] = _mean(generated, "tokens")
    tools = [r for r in rows if "tool_call" in r]
    if tools:
        out["tool_call_accuracy"] = _mean(tools, "tool_call")
        out["tool_call_name_accuracy"] = _mean(tools, "tool_call_name")
    choice = [r for r in rows if "correct" in r]
    if choice:
        out["accuracy"] = _mean(choice, "correct")
    scored = [r for r in rows if "nll" in r]
    if scored and sum(r["loss_tokens"] for r in scored):
        out["loss"] = sum(r["nll"] for r in scored) / sum(r["loss_tokens"] for r in scored)
        out["perplexity"] = math.exp(min(out["loss"], 50.0))
    return out


def metrics_of(rows_per_set: dict[str, list[dict]], model: str) -> dict:
    every = [r for rows in rows_per_set.values() for r in rows]
    return {"model": model, "overall": summarize(every),
            "datasets": {name: summarize(rows) for name, rows in rows_per_set.items()}}


def table(metrics: dict, other: dict | None = None) -> str:
    """The figures per set (and overall when there are several), with the compared model's and
    the difference when there is one."""
    names = list(metrics["datasets"]) + (["overall"] if len(metrics["datasets"]) > 1 else [])
    lines = []
    for name in names:
        mine = metrics["overall"] if name == "overall" else metrics["datasets"][name]
        theirs = None if other is None else (
            other["overall"] if name == "overall" else other["datasets"][name])
        head = f"{name}"
        if theirs is None:
            lines.append(f"{head}\n  {'metric':<14}{'value':>12}")
        else:
            lines.append(f"{head}\n  {'metric':<14}{short_label(metrics['model']):>20}"
                         f"{short_label(other['model']):>20}{'difference':>12}")
        for key, (label, digits) in SHOWN.items():
            if key not in mine:
                continue
            row = f"  {label:<14}"
            if theirs is None:
                lines.append(row + f"{mine[key]:>12.{digits}f}")
            else:
                b = theirs.get(key)
                lines.append(row + f"{mine[key]:>20.{digits}f}" + (
                    f"{b:>20.{digits}f}{mine[key] - b:>+12.{digits}f}" if b is not None else ""))
    return "\n".join(lines)


def short_label(label: str) -> str:
    """A model's name in a column: a folder's last two parts (run/checkpoint-50), at most 19
    characters."""
    parts = label.replace("\\", "/").rstrip("/").split("/")
    name = "/".join(parts[-2:])
    return name if len(name) <= 19 else "..." + name[-16:]


def chart(path: str, metrics: dict, other: dict) -> str:
    """A bar chart of the two models' overall figures (those on a 0-100 scale, and shares
    scaled to 0-100), saved as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    share = {"exact_match", "stopped", "tool_call_accuracy", "tool_call_name_accuracy",
             "accuracy"}
    keys = [k for k in SHOWN if k in metrics["overall"] and k in other["overall"]
            and (k in share or k in (*ROUGE_TYPES, "bleu4"))]
    scale = [100.0 if k in share else 1.0 for k in keys]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(keys) + 2), 4), dpi=100)
    width = 0.38
    xs = range(len(keys))
    for off, m in ((-width / 2, metrics), (width / 2, other)):
        vals = [m["overall"][k] * s for k, s in zip(keys, scale)]
        bars = ax.bar([x + off for x in xs], vals, width, label=short_label(m["model"]))
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(list(xs), [SHOWN[k][0] + (" (%)" if k in share else "") for k in keys],
                  rotation=20, ha="right")
    ax.set_ylim(0, 105)
    ax.set_title("swiftlite eval: " + ", ".join(metrics["datasets"]))
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
