#!/usr/bin/env python3
"""The GPU and NPU paths as users run them, in a few minutes on one accelerator.

  python scripts/gpu_smoke.py [--model tiny-qwen2] [--steps 5] [--out gpu_smoke.json]

Prints the versions and the hardware decisions, then runs each case as a user would (the
`swiftlite` CLI in a child process) and writes one JSON object of results and figures:
  train_*   sft for --steps steps: padding-free SDPA in the device's dtype, fp16 (loss
            scaling), padded batches (the first-step loss must equal padding-free's),
            flash-attention when it imports, ZeRO-2, ZeRO-2 offload, ZeRO-3 (2 processes
            when 2 devices are visible); first loss, tokens/s, peak device memory
  oom       an accelerator only: a batch whose logits cannot fit (64 samples of 4,000
            tokens, no checkpointing, no chunked loss); the run must stop with the ladder
  merge     merge-lora of the padding-free run; infer_* its answer in auto and fp16, and
            with --device_map auto
On a CPU it runs what applies there (a check of the script itself; CI never runs it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def swiftlite(*args, env=None, timeout=900) -> tuple[int, str, float]:
    t = time.time()
    r = subprocess.run([sys.executable, "-m", "swiftlite.cli", *map(str, args)],
                       capture_output=True, text=True, env={**os.environ, **(env or {})},
                       timeout=timeout, cwd=REPO)
    return r.returncode, r.stdout + r.stderr, round(time.time() - t, 1)


def run_dir(out: str) -> str | None:
    runs = sorted(d for d in os.listdir(out) if d.startswith("v")) if os.path.isdir(out) else []
    return os.path.join(out, runs[-1]) if runs else None


def train(name: str, work: str, common: list, *flags, env=None) -> dict:
    out = os.path.join(work, name)
    rc, log, wall = swiftlite("sft", *common, "--output_dir", out, *flags, env=env)
    result = {"rc": rc, "wall_s": wall, "flags": " ".join(map(str, flags))}
    folder = run_dir(out)
    rows = []
    if folder and os.path.exists(os.path.join(folder, "logging.jsonl")):
        with open(os.path.join(folder, "logging.jsonl")) as f:
            rows = [json.loads(line) for line in f if '"loss"' in line]
    if rows:
        result.update(first_loss=rows[0]["loss"], last_loss=rows[-1]["loss"],
                      tokens_per_s=rows[-1].get("tokens_per_s"),
                      peak_gpu_mb=max(r.get("peak_gpu_mb", 0) for r in rows),
                      run_dir=folder)
    decided = [line for line in log.splitlines() if "training on" in line or "WARNING" in line]
    result["log"] = decided[:6]
    if rc != 0:
        result["error"] = log[-3000:]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-qwen2")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default="gpu_smoke.json")
    a = ap.parse_args()
    from swiftlite.runtime import hardware
    hw = hardware.detect()
    results = {"versions": _versions(), "hardware": hardware.describe(hw)}
    print(json.dumps(results, indent=2), flush=True)
    work = tempfile.mkdtemp(prefix="gpu_smoke_")
    common = ["--model", a.model, "--dataset", "self-cognition#64", "--max_steps", a.steps,
              "--logging_steps", 1, "--save_steps", 1000, "--report_to", "none",
              "--per_device_train_batch_size", 4, "--gradient_accumulation_steps", 1,
              "--lora_dropout", 0, "--seed", 1]
    accel = hw.device in ("cuda", "npu")
    cases = {"train_auto": [], "train_padded": ["--padding_free", "false"]}
    if accel:
        cases["train_fp16"] = ["--torch_dtype", "float16"]
        if hw.device == "cuda" and hardware.flash_attn_installed():
            cases["train_flash"] = ["--attn_impl", "flash_attention_2"]
    cases["train_zero2"] = ["--deepspeed", "zero2"]
    cases["train_zero2_offload"] = ["--deepspeed", "zero2_offload"]
    for name, flags in cases.items():
        results[name] = train(name, work, common, *flags)
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "error"}),
              flush=True)
    if hw.count >= 2:
        results["train_zero3_2proc"] = train("train_zero3_2proc", work, common, "--deepspeed",
                                             "zero3", env={"NPROC_PER_NODE": "2"})
    if accel:
        results["oom"] = _oom(work, a.model)
        print("oom", json.dumps(results["oom"]), flush=True)
    auto, padded = results["train_auto"], results["train_padded"]
    if "first_loss" in auto and "first_loss" in padded:
        results["padded_vs_padding_free_first_loss"] = abs(auto["first_loss"] -
                                                           padded["first_loss"])
    ckpt = auto.get("run_dir") and os.path.join(auto["run_dir"], f"checkpoint-{a.steps}")
    if ckpt and os.path.isdir(ckpt):
        rc, log, wall = swiftlite("merge-lora", "--ckpt_dir", ckpt)
        results["merge"] = {"rc": rc, "wall_s": wall, "log": log.splitlines()[-4:]}
        for dtype in ("auto",) + (("float16",) if accel else ()):
            rc, log, wall = swiftlite("infer", "--ckpt_dir", ckpt + "-merged", "--query",
                                      "Who are you?", "--torch_dtype", dtype,
                                      "--max_new_tokens", 32)
            results[f"infer_{dtype}"] = {"rc": rc, "wall_s": wall, "answer": log[-400:]}
        rc, log, wall = swiftlite("infer", "--ckpt_dir", ckpt, "--query", "Who are you?",
                                  "--device_map", "auto", "--max_new_tokens", 32)
        results["infer_device_map_auto"] = {"rc": rc, "wall_s": wall, "answer": log[-400:]}
    with open(a.out, "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps({k: (v.get("rc") if isinstance(v, dict) and "rc" in v else v)
                      for k, v in results.items() if k != "versions"}))


def _oom(work: str, model: str) -> dict:
    data = os.path.join(work, "long.jsonl")
    with open(data, "w") as f:
        for i in range(64):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Story {i}"},
                                             {"role": "assistant",
                                              "content": "once upon a time " * 1000}]}) + "\n")
    out = os.path.join(work, "oom")
    rc, log, wall = swiftlite("sft", "--model", model, "--dataset", data, "--max_steps", 1,
                              "--max_length", 4096, "--per_device_train_batch_size", 64,
                              "--gradient_accumulation_steps", 1, "--gradient_checkpointing",
                              "false", "--chunked_loss", "false", "--report_to", "none",
                              "--output_dir", out)
    return {"rc": rc, "wall_s": wall, "ladder": "Next step:" in log,
            "traceback": "Traceback" in log,
            "advice": [line for line in log.splitlines() if "out of memory" in line
                       or "Next step" in line or "If that is not" in line][:3]}


def _versions() -> dict:
    import importlib.metadata as md
    out = {}
    for name in ("torch", "transformers", "peft", "deepspeed", "accelerate", "flash-attn",
                 "bitsandbytes", "swiftlite"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    import torch
    out["cuda"] = torch.version.cuda
    return out


if __name__ == "__main__":
    main()
