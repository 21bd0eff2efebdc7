"""Inference and merge benchmark on SmolLM2-135M-Instruct. One JSON line per measurement.

  python benchmarks/bench_infer.py                       # generation + merge memory
  python benchmarks/bench_infer.py --skip merge          # generation only
  python benchmarks/bench_infer.py --ckpt_dir output/.../checkpoint-50   # merge this adapter

generate: greedy generation with swiftlite's InferEngine model and generation config
  (left-padded batches) for batch sizes 1 and 8, every answer exactly --max_new_tokens long:
  generated tokens per second (all rows) and time to first token (prefill + first step).
merge: peak resident memory (ru_maxrss) of `swiftlite merge-lora` (tensor by tensor) against a
  naive peft merge_and_unload + save_pretrained, each in a fresh process, on the same adapter;
  plus the resident memory of a process that only imported the libraries, for reference.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain photosynthesis in two sentences.", "Name three prime numbers.",
             "Who wrote Hamlet?", "Give me a tip for learning Python.",
             "What is 12 times 12?", "Describe a cat in one sentence."]


def emit(**rec):
    # Other work on the machine changes the speed figures: say how busy it was.
    print(json.dumps({**rec, "load_avg_1m": round(os.getloadavg()[0], 1)}), flush=True)


class _Timing:
    """A generate() streamer that only records when the first new tokens arrive."""

    def __init__(self):
        self.calls, self.first = 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.first is None:  # call 1 is the prompt
            self.first = time.perf_counter()

    def end(self):
        pass


def bench_generate(model: str, max_new_tokens: int, repeats: int, batch_sizes, threads) -> None:
    import torch
    if threads:
        torch.set_num_threads(threads)
    from swiftlite.inference.engine import InferEngine
    engine = InferEngine.load(model=model)
    config = engine.generation_config(max_new_tokens=max_new_tokens)
    config.min_new_tokens = max_new_tokens  # fixed-length answers: throughput, not answer length
    pad = engine.tokenizer.pad_token_id
    engine.generate_batch(QUESTIONS[:2], max_new_tokens=8)  # warm-up
    for bs in batch_sizes:
        prompts = [engine.encode(q) for q in (QUESTIONS * 8)[:bs]]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        starts = torch.tensor([width - len(p) for p in prompts])
        mask = (torch.arange(width)[None, :] >= starts[:, None]).long()
        best = None
        for _ in range(repeats):
            timing = _Timing()
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = engine.model.generate(input_ids=ids, attention_mask=mask,
                                            generation_config=config, streamer=timing)
            dt = time.perf_counter() - t0
            n = out[:, width:].numel()
            rec = dict(seconds=round(dt, 3), new_tokens=n, tokens_per_s=round(n / dt, 1),
                       ttft_s=round(timing.first - t0, 3))
            best = rec if best is None or rec["tokens_per_s"] > best["tokens_per_s"] else best
        emit(bench="generate", model=model, batch_size=bs, max_new_tokens=max_new_tokens,
             dtype=engine.dtype, device=engine.device, threads=torch.get_num_threads(),
             repeats=repeats, **best)
    engine.unload()


CHILD = r"""
import json, os, sys, time
mode, ckpt, out = sys.argv[1:4]
import torch, transformers, peft, safetensors  # the same imports in every mode
t0 = time.time()
if mode.startswith("streaming"):
    import swiftlite
    swiftlite.merge_lora(ckpt, out, verify=mode == "streaming+verify")
elif mode == "naive":
    from swiftlite.pipelines.merge import naive_merge
    from swiftlite.inference.checkpoints import describe
    naive_merge(describe(ckpt).base_dir, ckpt, out, torch.float32)
from swiftlite.runtime.allocator import peak_rss_bytes
print(json.dumps({"peak_rss_mib": round(peak_rss_bytes() / 2**20),
                  "seconds": round(time.time() - t0, 1)}))
"""


def make_adapter(model: str, folder: str) -> str:
    """A LoRA adapter on all linear layers with non-zero random weights (rank 8)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from swiftlite.models import resolve_model
    from transformers import AutoModelForCausalLM
    base_dir, _ = resolve_model(model)
    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_pretrained(base_dir)
    get_peft_model(net, LoraConfig(r=8, lora_alpha=32, target_modules="all-linear",
                                   init_lora_weights=False)).save_pretrained(folder)
    return folder


def bench_merge(model: str, ckpt: str | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = ckpt or make_adapter(model, os.path.join(tmp, "adapter"))
        for mode in ("imports-only", "streaming", "streaming+verify", "naive"):
            out = os.path.join(tmp, f"merged-{mode}")
            r = subprocess.run([sys.executable, "-c", CHILD, mode, ckpt, out],
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"{mode} merge failed:\n{r.stderr[-3000:]}")
            res = json.loads(r.stdout.strip().splitlines()[-1])
            size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)
                       if f.endswith(".safetensors")) if os.path.isdir(out) else 0
            emit(bench="merge", model=model, method={
                "imports-only": "baseline: torch+transformers+peft imported, nothing merged",
                "streaming": "swiftlite merge-lora (tensor by tensor, --verify false)",
                "streaming+verify": "swiftlite merge-lora (tensor by tensor, then the logit "
                                    "check, which loads the model)",
                "naive": "peft merge_and_unload + save_pretrained"}[mode],
                 weights_mib=round(size / 2**20), **res)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--ckpt_dir", help="merge this LoRA checkpoint (default: a random adapter)")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--skip", choices=("generate", "merge"), action="append", default=[])
    a = p.parse_args()
    if "generate" not in a.skip:
        bench_generate(a.model, a.max_new_tokens, a.repeats, a.batch_sizes, a.threads)
    if "merge" not in a.skip:
        bench_merge(a.model, a.ckpt_dir)


if __name__ == "__main__":
    main()
