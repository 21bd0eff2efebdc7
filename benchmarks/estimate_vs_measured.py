"""Compare `swiftlite estimate` with the measured peak memory of real CPU training runs.

Each run is a child process: it imports torch/transformers/peft, records its resident memory
(the baseline), trains a few steps with `swiftlite.sft` on samples cut to exactly
--max_length tokens, and reports its peak resident memory (VmHWM). On a CPU the
"device" is the process itself: the memory training added on top of the process as it
stood when training began, plus the weights, is compared with the estimate's per-device
total for the "none" row (plain Trainer).

    .venv/bin/python benchmarks/estimate_vs_measured.py            # all runs, a markdown table
    .venv/bin/python benchmarks/estimate_vs_measured.py --runs tiny-qwen2:lora:ckpt
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

# model:train_type:checkpointing[:dtype]; bfloat16 runs use this CPU's AMX/AVX-512-BF16 units
RUNS = ["tiny-qwen2:lora:ckpt", "SmolLM2-135M-Instruct:lora:no", "SmolLM2-135M-Instruct:full:no",
        "SmolLM2-135M-Instruct:lora:no:bfloat16", "SmolLM2-135M-Instruct:full:ckpt",
        "tiny-qwen2:full:no"]


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS"))
    return int(line.split()[1]) * 1024


def write_long_samples(path: str, n: int) -> str:
    """Conversations whose reply is far longer than any --max_length used here, so that
    --truncation_strategy right makes every sample exactly --max_length tokens."""
    words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly "
             "judge boxing matches in the park ").split()
    with open(path, "w", encoding="utf-8") as f:
        for k in range(n):
            reply = " ".join(words[(k + j) % len(words)] for j in range(3000))
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Story {k}?"},
                                             {"role": "assistant", "content": reply}]}) + "\n")
    return path


def child(model: str, train_type: str, ckpt: bool, max_length: int, batch: int, steps: int,
          out: str, dtype: str) -> dict:
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import swiftlite
    from swiftlite.models.builtin import build
    build(model)  # built and cached before the baseline, like any local model folder
    data = write_long_samples(os.path.join(out, "long.jsonl"), batch * steps)
    # Also note the resident memory when training starts (model, tokenizer and data loaded).
    from swiftlite.training.callbacks import JsonlLogger
    at_start, original = {}, JsonlLogger.on_train_begin

    def on_train_begin(self, *a, **kw):
        at_start.setdefault("rss", rss_bytes())
        params = {id(p): p.numel() * p.element_size() for p in kw["model"].parameters()}
        at_start.setdefault("weights", sum(params.values()))
        return original(self, *a, **kw)
    JsonlLogger.on_train_begin = on_train_begin
    base = rss_bytes()
    swiftlite.sft(model=model, dataset=[data], train_type=train_type, max_length=max_length,
                  truncation_strategy="right", per_device_train_batch_size=batch,
                  gradient_accumulation_steps=1, max_steps=steps, gradient_checkpointing=ckpt,
                  # the estimate is a GPU's, where no frozen output is kept unless asked for
                  selective_checkpointing=False, torch_dtype=dtype, logging_steps=1,
                  save_steps=10_000, output_dir=out, report_to="none", load_from_cache_file=False)
    from swiftlite.runtime.allocator import peak_rss_bytes
    peak = peak_rss_bytes()
    # Training memory as a device would hold it: the weights, plus everything training added
    # on top of the process as it stood when training began (tokenizer, data and Python
    # objects stay out: on a GPU they live in host memory).
    return {"baseline": base, "train_start": at_start["rss"], "peak": peak,
            "weights": at_start["weights"],
            "measured": peak - at_start["rss"] + at_start["weights"]}


def estimated(model: str, train_type: str, ckpt: bool, max_length: int, batch: int,
              dtype: str) -> int:
    from swiftlite.estimate.memory import estimate, model_spec
    from swiftlite.models.meta import read_config
    name, config = read_config(model)
    spec = model_spec(name, config, train_type)
    row = estimate(spec, dtype=dtype, train_type=train_type, max_length=max_length,
                   batch_size=batch)[0]
    assert row.stage == "none"
    return row.gpu_total if ckpt else row.gpu_total_no_ckpt


def measure(run: str, max_length: int, batch: int, steps: int) -> dict:
    model, train_type, ckpt, dtype = (run.split(":") + ["float32"])[:4]
    # glibc keeps freed heap memory resident (fragmentation), so a process's RSS overstates
    # the tensors alive at its peak by up to a third here; allocations of 64 KiB and more
    # from mmap are returned at once, and RSS then tracks live memory.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    with tempfile.TemporaryDirectory() as out:
        r = subprocess.run([sys.executable, __file__, "--child", run, "--max_length",
                            str(max_length), "--batch", str(batch), "--steps", str(steps),
                            "--out", out], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{run} failed:\n{r.stderr[-3000:]}")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    print(json.dumps({"run": run, **got}), file=sys.stderr, flush=True)
    est = estimated(model, train_type, ckpt == "ckpt", max_length, batch, dtype)
    return {"run": run, **got, "estimated": est,
            "error_pct": round(100 * (est - got["measured"]) / got["measured"], 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", nargs="+", default=RUNS)
    p.add_argument("--max_length", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--child")
    p.add_argument("--out")
    a = p.parse_args()
    if a.child:
        model, train_type, ckpt, dtype = (a.child.split(":") + ["float32"])[:4]
        print(json.dumps(child(model, train_type, ckpt == "ckpt", a.max_length, a.batch,
                               a.steps, a.out, dtype)))
        return
    print(f"micro-batch {a.batch} x {a.max_length} tokens, {a.steps} steps, float32, CPU\n")
    print("| run (model:train_type:checkpointing:dtype) | setup | weights | peak - start | "
          "measured | estimated | error |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for run in a.runs:
        m = measure(run, a.max_length, a.batch, a.steps)
        mib = {k: f"{m[k] / 2**20:,.0f}" for k in ("weights", "measured", "estimated")}
        print(f"| {run} | {(m['train_start'] - m['baseline']) / 2**20:,.0f} | {mib['weights']} "
              f"| {(m['peak'] - m['train_start']) / 2**20:,.0f} | {mib['measured']} | "
              f"{mib['estimated']} | {m['error_pct']:+.1f}% |", flush=True)
    print("\nMiB. setup: memory added before training (tokenizer, data, model); weights: the "
          "loaded parameters; measured = peak - start + weights; error = (estimated - "
          "measured) / measured.")


if __name__ == "__main__":
    main()
