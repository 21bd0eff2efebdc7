#!/usr/bin/env python
"""Measure swiftlite LoRA SFT on this machine.

  # 1. a whole `swiftlite sft` run (the settings of benchmarks/peers: LoRA r8/alpha32 all-linear,
  #    batch 4, max_length 512, gradient checkpointing, 30 steps), one JSON line:
  python benchmarks/bench_sft.py run --model SmolLM2-135M-Instruct --dataset data.jsonl \
      [-- --torch_dtype bfloat16]

  # 2. speed-ups on/off, interleaved step by step in one process on the same batches (fair on a
  #    shared, noisy machine): tokens/s of each variant and its ratio to the first one
  python benchmarks/bench_sft.py ab --model SmolLM2-135M-Instruct --dataset data.jsonl \\
      --variant base: --variant nochunk:chunked_loss=false --variant bf16:torch_dtype=bfloat16

  # 3. peak memory of one forward+backward of a LENGTH-token sample (fresh process per case)
  python benchmarks/bench_sft.py memory --model tiny-qwen2 --length 2048 4096

  # 4. where a step's time goes (torch profiler over STEPS steps after a warm-up step): shares
  #    of matmuls, attention, dropout masks, casts, other element-wise work, optimizer, collation
  python benchmarks/bench_sft.py profile --steps 3 --variant default:torch_dtype=auto

Every command first prints one {"machine": ...} line: the CPU, the flags that decide swiftlite's
CPU dtype, the threads, and this machine's measured matmul rates (fp32 by torch's BLAS and by
oneDNN, and bf16; GFLOP/s of an n x n product, best of 5, with n = 2048 unless one product
would take over a second: matmul_n says), so every figure says what it was measured on.
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


def matmul_gflops(dtype, repeats: int = 5, onednn: bool = False) -> tuple[float, int]:
    """GFLOP/s of an n x n x n matmul in `dtype` on this CPU (best of `repeats`), and n: 2048,
    or less where one product would take over a second (bf16 on a CPU without bf16 units runs
    at a hundredth of the fp32 rate); `onednn`: by oneDNN's kernels (what --onednn_fp32 uses)
    rather than torch's choice (BLAS for fp32)."""
    import torch

    from swiftlite.training.speedups.onednn_fp32 import linear
    n = 256
    while True:
        x, y = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        mm = (lambda: linear(x, y, onednn=True)) if onednn else (lambda: torch.mm(x, y))
        mm()  # oneDNN picks and builds its kernel on the first call
        t = time.perf_counter()
        mm()
        best = time.perf_counter() - t
        if n == 2048 or best * 8 > 1.0:  # the next size up would take over a second
            break
        n *= 2
    for _ in range(repeats - 1):
        t = time.perf_counter()
        mm()
        best = min(best, time.perf_counter() - t)
    return round(2 * n ** 3 / best / 1e9, 1), n


def machine() -> dict:
    import torch

    from swiftlite.runtime import allocator, hardware
    rates = {"float32": matmul_gflops(torch.float32),
             "float32_onednn": matmul_gflops(torch.float32, onednn=True),
             "bfloat16": matmul_gflops(torch.bfloat16)}
    return {"cpu": hardware.describe_cpu(), "flags": list(hardware.cpu_flags()),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "allocator": allocator.active(),
            "matmul_gflops": {k: rate for k, (rate, _) in rates.items()},
            "matmul_n": {k: n for k, (_, n) in rates.items()}}


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


def _setup(a):
    """The batches of a.steps steps and one prepared model per --variant, all from real
    swiftlite parts (encode, load_model, prepare_model, collator), with AdamW as the Trainer."""
    import torch

    from swiftlite.config.arguments import SftArguments
    from swiftlite.config.parsing import build
    from swiftlite.data import load_conversations
    from swiftlite.data.encode import encode_dataset
    from swiftlite.models import resolve_model
    from swiftlite.models.loader import load_model, load_tokenizer
    from swiftlite.data.template import get_template
    from swiftlite.runtime import hardware
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
        dtype = hardware.training_dtype(args.torch_dtype, hardware.detect(), "lora")
        torch.manual_seed(42)
        model = prepare_model(load_model(model_dir, hardware.weights_dtype(dtype, "lora")), args)
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                                weight_decay=0.1)
        from swiftlite.training.speedups.batch_threads import threads
        runs.append({"name": name, "args": args, "model": model, "opt": opt,
                     "threads": threads(model, args, "cpu"),
                     "collate": collator(tok, args.padding_free), "t": 0.0, "cpu": 0.0, "tok": 0,
                     "losses": []})
    return batches, runs


def _forward(r, batch, num_items=None):
    from swiftlite.training.speedups.chunked_loss import supervised_head_loss
    return (supervised_head_loss(r["model"], batch, num_items) if r["args"].chunked_loss
            else r["model"](**batch, num_items_in_batch=num_items).loss)


def _forward_backward(r, batch):
    """As the Trainer's step: with --batch_threads, the batch's parts in threads, each loss
    normalised by the whole batch's trained tokens."""
    if r["threads"] == 1:
        loss = _forward(r, batch)
        loss.backward()
        return loss
    from swiftlite.training.speedups.batch_threads import train_step
    num_items = int((batch["labels"][:, 1:] != -100).sum())

    def part(p):
        loss = _forward(r, p, num_items)
        loss.backward()
        return loss.detach()
    return train_step(part, batch, r["threads"])


def _optimizer_step(r):
    import torch
    torch.nn.utils.clip_grad_norm_([p for p in r["model"].parameters() if p.requires_grad], 1.0)
    r["opt"].step()
    r["opt"].zero_grad()


def cmd_ab(a, extra):
    """Interleaved steps of each variant on the same batches."""
    batches, runs = _setup(a)
    for step, samples in enumerate(batches):
        for r in runs:
            batch = r["collate"]([dict(s) for s in samples])
            t, c = time.perf_counter(), time.process_time()
            loss = _forward_backward(r, batch)
            _optimizer_step(r)
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


# Operator groups of a profiled step, by aten name (self time). The dropout group also holds
# the other uses of these ops (attention's masking, the loss' label mask), a few percent.
PROFILE_GROUPS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
    "attention": ("flash_attention", "scaled_dot_product", "_efficient_attention"),
    # fast_dropout.py draws the drop positions (uniform_ ... searchsorted) and zeroes them;
    # torch's dropout (--fast_dropout false) draws a mask with bernoulli_
    "dropout": ("aten::uniform_", "aten::log1p", "aten::floor", "aten::cumsum",
                "aten::searchsorted", "aten::index_fill", "aten::bernoulli"),
    "casts and copies": ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous"),
    "log-softmax and loss": ("log_softmax", "nll_loss", "cross_entropy"),
}


def _group(op: str) -> str:
    return next((g for g, keys in PROFILE_GROUPS.items() if any(k in op for k in keys)),
                "other element-wise and bookkeeping")


def cmd_profile(a, extra):
    """Where the time of a step of the first --variant goes: the steps after a warm-up step,
    timed by phase (collation, forward, backward with checkpointing's recompute, optimizer; the
    chunked loss computes the LM head's gradient in forward); then the forward+backward of the
    same batches again under the torch profiler, for the operators' shares (the profiler's own
    overhead makes its timings longer, so the seconds come from the unprofiled pass)."""
    from torch.profiler import ProfilerActivity, profile
    batches, runs = _setup(a)
    r, ops = runs[0], {}
    phases = {"collate": 0.0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    for step, samples in enumerate(batches):
        t = time.perf_counter()
        batch = r["collate"]([dict(s) for s in samples])
        t1 = time.perf_counter()
        loss = _forward(r, batch)
        tf = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        _optimizer_step(r)
        if step:
            phases["collate"] += t1 - t
            phases["forward"] += tf - t1
            phases["backward"] += t2 - tf
            phases["optimizer"] += time.perf_counter() - t2
            r["tok"] += sum(len(s["input_ids"]) for s in samples)
    for samples in batches[1:]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _forward_backward(r, r["collate"]([dict(s) for s in samples]))
        for e in prof.key_averages():
            ops[e.key] = ops.get(e.key, 0) + e.self_cpu_time_total
        r["model"].zero_grad()
    shares = {}
    for op, us in ops.items():
        shares[_group(op)] = shares.get(_group(op), 0) + us
    total, wall = sum(ops.values()), sum(phases.values())
    print(json.dumps({"variant": r["name"], "steps": a.steps - 1, "tokens": r["tok"],
                      "seconds": {k: round(v, 2) for k, v in phases.items()},
                      "tokens_per_s": round(r["tok"] / wall, 1),
                      "forward_backward_shares": {k: round(v / total, 3) for k, v in
                                                  sorted(shares.items(), key=lambda kv: -kv[1])},
                      "top_operators": {k: round(v / total, 3) for k, v in
                                        sorted(ops.items(), key=lambda kv: -kv[1])[:15]}}),
          flush=True)


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
    # The allocator of `swiftlite sft` (which re-executes itself under tcmalloc): under glibc
    # the in-process steps of `ab` and `profile` were slower than the command's, with the
    # element-wise ops' shares inflated by page faults on fresh buffers (docs/performance.md).
    from swiftlite.runtime.allocator import reexec_with_tcmalloc
    reexec_with_tcmalloc(sys.argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("run", "ab", "memory", "profile"):
        p = sub.add_parser(name)
        p.add_argument("--model", default="/tmp/bench_models/smol135m")
        p.add_argument("--dataset", default="/tmp/bench_data/train.jsonl")
        p.add_argument("--template", default="chatml")
        p.add_argument("--steps", type=int, default=30)
        if name == "run":
            p.add_argument("--output_dir")
        if name in ("ab", "profile"):
            p.add_argument("--variant", action="append", required=name == "ab",
                           help="NAME:flag=value,flag=value (SftArguments fields)")
        if name == "ab":
            p.add_argument("--warmup", type=int, default=1, help="untimed first steps")
        if name == "memory":
            p.add_argument("--length", type=int, nargs="+", default=[2048, 4096])
            p.add_argument("--dtype", default="float32")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if a.cmd == "profile" and not a.variant:
        a.variant = ["default:torch_dtype=auto"]
    print(json.dumps({"machine": machine()}), flush=True)
    sys.exit({"run": cmd_run, "ab": cmd_ab, "memory": cmd_memory,
              "profile": cmd_profile}[a.cmd](a, extra) or 0)


if __name__ == "__main__":
    main()
