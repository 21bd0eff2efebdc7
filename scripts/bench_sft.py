#!/usr/bin/env python
"""Measure swiftlite LoRA SFT on this machine.

  # 1. a whole `swiftlite sft` run (the settings of ../shared/bench: LoRA r8/alpha32 all-linear,
  #    batch 4, max_length 512, gradient checkpointing, 30 steps), one JSON line:
  python scripts/bench_sft.py run --model SmolLM2-135M-Instruct --dataset data.jsonl [-- --torch_dtype bfloat16]

  # 2. speed-ups on/off, interleaved step by step in one process on the same batches (fair on a
  #    shared, noisy machine): tokens/s of each variant and its ratio to the first one
  python scripts/bench_sft.py ab --model SmolLM2-135M-Instruct --dataset data.jsonl \\
      --variant base: --variant nochunk:chunked_loss=false --variant bf16:torch_dtype=bfloat16

  # 3. peak memory of one forward+backward of a LENGTH-token sample (fresh process per case)
  python scripts/bench_sft.py memory --model tiny-qwen2 --length 2048 4096
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

BENCH = ["--train_type", "lora", "--lora_rank", "8", "--lora_alpha", "32", "--lora_dropout",
         "0.05", "--target_modules", "all-linear", "--max_length", "512",
         "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
         "--learning_rate", "1e-4", "--lr_scheduler_type", "cosine", "--warmup_ratio", "0",
         "--weight_decay", "0.1", "--gradient_checkpointing", "true", "--eval_strategy", "no",
         "--save_strategy", "no", "--logging_steps", "1", "--report_to", "none",
         "--dataloader_num_workers", "0", "--seed", "42"]


def _tree_rss(root: int) -> int:
    """Summed RSS (bytes) of root and its descendants."""
    kids, total = {}, 0
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                kids.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(p))
        except (OSError, ValueError, IndexError):
            pass
    todo = [root]
    while todo:
        p = todo.pop()
        todo += kids.get(p, [])
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            pass
    return total


def cmd_run(a, extra):
    out = a.output_dir or f"/tmp/bench_sft_{os.getpid()}"
    cmd = [os.path.join(os.path.dirname(sys.executable), "swiftlite"), "sft", "--model", a.model,
           "--dataset", a.dataset, "--template", a.template, "--max_steps", str(a.steps),
           "--output_dir", out, "--add_version", "false", *BENCH, *extra]
    t0, peak, first = time.time(), [0], [None]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    done = threading.Event()

    def poll():
        while not done.wait(0.2):
            peak[0] = max(peak[0], _tree_rss(proc.pid))
    threading.Thread(target=poll, daemon=True).start()
    for line in proc.stderr:
        if first[0] is None and "'loss'" in line:
            first[0] = time.time() - t0
    rc = proc.wait()
    done.set()
    rows = [json.loads(x) for x in open(os.path.join(out, "logging.jsonl"))] if rc == 0 else []
    steps = [r for r in rows if "loss" in r]
    end = next((r for r in rows if "train_runtime" in r), {})
    tokens = end.get("num_input_tokens_seen") or (steps[-1].get("num_input_tokens_seen")
                                                  if steps else None)
    train_s = end.get("train_runtime")
    print(json.dumps({"tool": "swiftlite", "rc": rc, "args": " ".join(extra),
                      "wall_s": round(time.time() - t0, 2), "train_s": train_s,
                      "first_step_s": round(first[0], 2) if first[0] else None, "tokens": tokens,
                      "tokens_per_s": round(tokens / float(train_s), 1) if tokens and train_s
                      else None, "peak_rss_mb": round(peak[0] / 2**20),
                      "final_loss": float(steps[-1]["loss"]) if steps else None}))
    return rc


def _variant(spec: str, base: dict):
    name, _, kv = spec.partition(":")
    values = dict(base)
    for item in filter(None, kv.split(",")):
        k, _, v = item.partition("=")
        values[k] = v
    return name, values


def cmd_ab(a, extra):
    """Interleaved steps of each variant on the same batches; real swiftlite parts throughout
    (encode, load_model, prepare_model, collator, supervised_head_loss), AdamW as the Trainer."""
    import torch

    from swiftlite.config.arguments import SftArguments
    from swiftlite.config.parsing import build
    from swiftlite.data import load_conversations
    from swiftlite.data.encode import encode_dataset
    from swiftlite.training.speedups.chunked_loss import supervised_head_loss
    from swiftlite.models import resolve_model
    from swiftlite.models.loader import load_model, load_tokenizer
    from swiftlite.data.template import get_template
    from swiftlite.training.trainer import collator
    from swiftlite.training.tuners import prepare_model
    base = {"model": a.model, "dataset": [a.dataset], "template": a.template, "max_length": 512,
            "lora_dropout": 0.05, "torch_dtype": "float32"}
    variants = [_variant(s, base) for s in a.variant]
    model_dir, _ = resolve_model(a.model)
    tok = load_tokenizer(model_dir)
    convs, _ = load_conversations([a.dataset], seed=42)
    ds, _ = encode_dataset(convs, get_template(a.template, tok), max_length=512,
                           truncation_strategy="delete", name="train", use_cache=True)
    g = torch.Generator().manual_seed(42)
    order = torch.randperm(len(ds), generator=g).tolist()
    batches = [[{k: ds[i][k] for k in ("input_ids", "labels")} for i in order[s * 4:s * 4 + 4]]
               for s in range(a.steps)]
    runs = []
    for name, values in variants:
        args = build(SftArguments, values)
        torch.manual_seed(42)
        model = prepare_model(load_model(model_dir, args.torch_dtype), args)
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                                weight_decay=0.1)
        runs.append({"name": name, "args": args, "model": model, "opt": opt,
                     "collate": collator(tok, args.padding_free), "t": 0.0, "cpu": 0.0, "tok": 0,
                     "losses": []})
    for step, samples in enumerate(batches):
        for r in runs:
            batch = r["collate"]([dict(s) for s in samples])
            t, c = time.perf_counter(), time.process_time()
            if r["args"].chunked_loss:
                loss = supervised_head_loss(r["model"], batch)
            else:
                loss = r["model"](**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(
                [p for p in r["model"].parameters() if p.requires_grad], 1.0)
            r["opt"].step()
            r["opt"].zero_grad()
            dt, dc = time.perf_counter() - t, time.process_time() - c
            if step >= a.warmup:
                r["t"] += dt
                r["cpu"] += dc
                r["tok"] += sum(len(s["input_ids"]) for s in samples)
            r["losses"].append(round(loss.item(), 4))
            print(f"step {step} {r['name']}: {dt:.2f} s ({dc:.2f} s CPU)", file=sys.stderr,
                  flush=True)
    # CPU seconds as well as wall seconds: on a shared machine (other jobs on the cores) the
    # CPU time of a single-threaded run (OMP_NUM_THREADS=1) is the steadier measure.
    ref, ref_cpu = runs[0]["tok"] / runs[0]["t"], runs[0]["tok"] / runs[0]["cpu"]
    for r in runs:
        tps, tpc = r["tok"] / r["t"], r["tok"] / r["cpu"]
        print(json.dumps({"variant": r["name"], "tokens_per_s": round(tps, 1),
                          "ratio": round(tps / ref, 3), "tokens_per_cpu_s": round(tpc, 1),
                          "cpu_ratio": round(tpc / ref_cpu, 3), "steps": a.steps - a.warmup,
                          "losses": r["losses"]}), flush=True)


_MEM_CHILD = r"""
import json, sys, torch
from swiftlite.config.arguments import SftArguments
from swiftlite.runtime.allocator import peak_rss_bytes
from swiftlite.training.speedups.chunked_loss import supervised_head_loss
from swiftlite.models import resolve_model
from swiftlite.models.loader import load_model
from swiftlite.training.tuners import prepare_model
model_dir, length, chunked, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
model = prepare_model(load_model(resolve_model(model_dir)[0], dtype),
                      SftArguments(model="x", dataset=["x"]))
model.train()
torch.manual_seed(0)
ids = torch.randint(0, model.config.vocab_size - 1000, (1, length))
labels = ids.clone()
labels[:, : length // 4] = -100  # a prompt: a quarter of the row is not trained
before = peak_rss_bytes()
batch = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(length)[None]}
loss = supervised_head_loss(model, batch) if chunked else model(**batch).loss
loss.backward()
peak = peak_rss_bytes()
print(json.dumps({"length": length, "chunked_loss": chunked, "dtype": dtype,
                  "loss": round(loss.item(), 5), "peak_rss_mb": round(peak / 2**20),
                  "step_extra_mb": round((peak - before) / 2**20)}))
"""


def cmd_memory(a, extra):
    for length in a.length:
        for chunked in ("0", "1"):
            out = subprocess.run([sys.executable, "-c", _MEM_CHILD, a.model, str(length), chunked,
                                  a.dtype], capture_output=True, text=True)
            print(out.stdout.strip() or out.stderr[-2000:], flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("run", "ab", "memory"):
        p = sub.add_parser(name)
        p.add_argument("--model", default="/tmp/bench_models/smol135m")
        p.add_argument("--dataset", default="/tmp/bench_data/train.jsonl")
        p.add_argument("--template", default="chatml")
        p.add_argument("--steps", type=int, default=30)
        if name == "run":
            p.add_argument("--output_dir")
        if name == "ab":
            p.add_argument("--variant", action="append", required=True,
                           help="NAME:flag=value,flag=value (SftArguments fields)")
            p.add_argument("--warmup", type=int, default=1, help="untimed first steps")
        if name == "memory":
            p.add_argument("--length", type=int, nargs="+", default=[2048, 4096])
            p.add_argument("--dtype", default="float32")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    sys.exit({"run": cmd_run, "ab": cmd_ab, "memory": cmd_memory}[a.cmd](a, extra) or 0)


if __name__ == "__main__":
    main()
