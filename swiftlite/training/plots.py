"""Loss curves of a run, drawn from its logging.jsonl."""
from __future__ import annotations

import json
import os


def _rows(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "logging.jsonl")
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def plot_losses(run_dir: str) -> list[str]:
    """images/train_loss.png (and eval_loss.png) from logging.jsonl."""
    return _plot(run_dir, (("loss", "train_loss"), ("eval_loss", "eval_loss")))


def plot_rewards(run_dir: str) -> list[str]:
    """Preference training: images/train_rewards_margins.png and
    images/train_rewards_accuracies.png (and their eval_ twins) from logging.jsonl."""
    return _plot(run_dir, [(f"{p}rewards/{m}", f"{p or 'train_'}rewards_{m}")
                           for p in ("", "eval_") for m in ("margins", "accuracies")])


def _plot(run_dir: str, series) -> list[str]:
    rows = _rows(run_dir)
    if not rows:
        return []
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = []
    for key, name in series:
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if not pts:
            continue
        os.makedirs(os.path.join(run_dir, "images"), exist_ok=True)
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, linewidth=1.2, label=key)
        if len(pts) >= 10:  # a smoothed line makes the trend readable on noisy steps
            k = max(2, len(pts) // 10)
            sm = [sum(ys[max(0, i - k + 1):i + 1]) / len(ys[max(0, i - k + 1):i + 1])
                  for i in range(len(ys))]
            ax.plot(xs, sm, linewidth=2, label=f"{key} (moving mean of {k})")
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.set_title(f"{name} - {os.path.basename(run_dir)}")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        target = os.path.join(run_dir, "images", f"{name}.png")
        fig.savefig(target)
        plt.close(fig)
        out.append(target)
    return out
