"""Peak memory of LoRA vs QLoRA (4-bit nf4, 8-bit) training, next to `swiftlite estimate`.

The model is Qwen2.5-0.5B-Instruct's architecture with random weights (built once from its
config.json and the real Qwen tokenizer, no hub needed). Each case is a child process that
trains a few steps with `swiftlite.sft` on samples cut to --max_length tokens and reports its
peak resident memory (VmHWM) above its resident memory before loading the model, while
loading and while training; on a CPU the process is the "device", so the training peak is
compared with the estimate's per-device total for the plain Trainer ("none" row, float32 as
swiftlite computes QLoRA on a CPU).

    .venv/bin/python benchmarks/bench_qlora.py                 # one JSON line per case
    .venv/bin/python benchmarks/bench_qlora.py --cases lora qlora4
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

CASES = {"lora": None, "qlora8": 8, "qlora4": 4}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(x.split(":", 1)[1].strip() for x in f if x.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def build_model(target: str) -> str:
    """Qwen2.5-0.5B-Instruct's config with random weights (bf16) and tiny-qwen2's tokenizer
    files (the real Qwen2 vocabulary and chat template)."""
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from swiftlite.models.builtin import build
    here = os.path.dirname(os.path.abspath(__file__))
    config = AutoConfig.from_pretrained(os.path.join(
        here, "..", "swiftlite", "models", "configs", "Qwen2.5-0.5B-Instruct.json"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = target + ".tmp"
    model.save_pretrained(tmp)
    tok = build("tiny-qwen2")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(tok, name)):
            shutil.copy(os.path.join(tok, name), tmp)
    os.rename(tmp, target)
    return target


def child(model: str, bits: int | None, max_length: int, steps: int, out: str) -> dict:
    import peft  # noqa: F401  (imported before the baseline, like any training process)
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import swiftlite
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from estimate_vs_measured import rss_bytes, write_long_samples
    data = write_long_samples(os.path.join(out, "long.jsonl"), steps)
    base = rss_bytes()
    # Loading reads the checkpoint through a memory map, whose pages count in RSS until it
    # ends (on a GPU they are host memory, not device memory): so the peak of training itself
    # is measured from the first step, after resetting the high-water mark (clear_refs 5).
    from swiftlite.training.callbacks import JsonlLogger
    original, marks = JsonlLogger.on_train_begin, {}

    def on_train_begin(self, *a, **kw):
        marks["load_peak"] = _hwm()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return original(self, *a, **kw)

    JsonlLogger.on_train_begin = on_train_begin
    swiftlite.sft(model=model, dataset=[data], max_steps=steps, max_length=max_length,
                  truncation_strategy="right", per_device_train_batch_size=1,
                  gradient_accumulation_steps=1, torch_dtype="float32", report_to="none",
                  save_steps=10_000, logging_steps=1, output_dir=os.path.join(out, "run"),
                  quant_bits=bits, load_from_cache_file=False)
    return {"train_peak": _hwm() - base, "load_peak": marks["load_peak"] - base}


def _hwm() -> int:
    with open("/proc/self/status") as f:
        return int(next(x for x in f if x.startswith("VmHWM")).split()[1]) * 1024


def estimate_bytes(model: str, bits: int | None, max_length: int) -> int:
    from swiftlite.config.arguments import EstimateArguments
    from swiftlite.estimate.plan import run
    r = run(EstimateArguments(model=model, torch_dtype="float32", max_length=max_length,
                              quant_bits=bits, gpu_memory="1000GB"))
    return next(row for row in r["rows"] if row["stage"] == "none")["gpu_total"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--max_length", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    from swiftlite.runtime.paths import cache_dir
    model = build_model(os.path.join(cache_dir("models"), "qwen2.5-0.5b-shaped-random"))
    if a.child:
        with tempfile.TemporaryDirectory() as out:
            print(json.dumps(child(model, CASES[a.child], a.max_length, a.steps, out)))
        return
    for case in a.cases:
        r = subprocess.run([sys.executable, __file__, "--child", case, "--max_length",
                            str(a.max_length), "--steps", str(a.steps)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"{case} failed:\n{r.stderr[-4000:]}")
        got = json.loads(r.stdout.strip().splitlines()[-1])
        est = estimate_bytes(model, CASES[case], a.max_length)
        print(json.dumps({"case": case, "model": "Qwen2.5-0.5B-shaped (random weights)",
                          "quant_bits": CASES[case], "max_length": a.max_length,
                          "dtype": "float32", "cpu": cpu_name(),
                          "train_peak_mib": round(got["train_peak"] / 2**20, 1),
                          "load_peak_mib": round(got["load_peak"] / 2**20, 1),
                          "estimate_mib": round(est / 2**20, 1),
                          "estimate_over_train_peak": round(est / got["train_peak"], 3)}),
              flush=True)


if __name__ == "__main__":
    main()
