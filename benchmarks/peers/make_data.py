#!/usr/bin/env python3
"""Write a fixed, seeded SFT dataset (no downloads, stdlib only).

  python3 make_data.py [--out DIR] [--n 512] [--seed 0] [--tokenizer MODEL_DIR --max-length 512]

Outputs in DIR (default: ./data next to this script):
  train.jsonl        OpenAI `messages` format (system/user/assistant), one sample a line
  dataset_info.json  LLaMA-Factory entry "bench_sft" pointing at train.jsonl
  stats.json         only with --tokenizer: per-sample token counts with the chat template,
                     truncated to --max-length (used by measure.py to estimate tokens)
"""
import argparse
import json
import os
import random

WORDS = ("model data train loss step batch token layer weight gradient memory speed value "
         "result system update matrix vector rank adapter linear output input sample length "
         "window cache kernel thread core shard window buffer queue graph node edge metric "
         "score format record field table index query answer reason method simple robust "
         "small large fast slow early late first last every other some many few each").split()
SYSTEMS = ["You are a helpful assistant.",
           "You are a concise assistant. Answer briefly and precisely.",
           "You are a patient teacher who explains things step by step."]
TOPICS = ["low-rank adapters", "gradient checkpointing", "data loaders", "tokenizers",
          "learning rate schedules", "mixed precision", "optimizer states", "padding",
          "attention masks", "checkpoint files", "batch sizes", "loss curves"]


def sentence(rng, lo, hi):
    w = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
    return " ".join(w).capitalize() + "."


def sample(rng):
    topic = rng.choice(TOPICS)
    user = f"Question {rng.randint(1, 9999)} about {topic}: " + " ".join(
        sentence(rng, 4, 12) for _ in range(rng.randint(1, 4)))
    # answer length drawn uniformly so totals spread over ~50..400 tokens
    n_words = rng.randint(10, 270)
    words, ans = 0, []
    while words < n_words:
        s = sentence(rng, 5, 15)
        ans.append(s)
        words += s.count(" ") + 1
    return {"messages": [{"role": "system", "content": rng.choice(SYSTEMS)},
                         {"role": "user", "content": user},
                         {"role": "assistant", "content": f"About {topic}: " + " ".join(ans)}]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "data"))
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", help="model dir; if given, write stats.json with token counts")
    ap.add_argument("--max-length", type=int, default=512)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rng = random.Random(a.seed)
    rows = [sample(rng) for _ in range(a.n)]
    with open(os.path.join(a.out, "train.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    info = {"bench_sft": {"file_name": "train.jsonl", "formatting": "sharegpt",
                          "columns": {"messages": "messages"},
                          "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                                   "assistant_tag": "assistant", "system_tag": "system"}}}
    with open(os.path.join(a.out, "dataset_info.json"), "w") as f:
        json.dump(info, f, indent=2)
    print(f"wrote {a.n} samples to {a.out}/train.jsonl")
    if a.tokenizer:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(a.tokenizer)
        lens = [min(len(tok.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"]),
                    a.max_length) for r in rows]
        st = {"n": len(lens), "max_length": a.max_length, "min": min(lens), "max": max(lens),
              "mean": sum(lens) / len(lens), "lengths": lens}
        with open(os.path.join(a.out, "stats.json"), "w") as f:
            json.dump(st, f)
        print(f"tokens/sample min {st['min']} mean {st['mean']:.1f} max {st['max']}")


if __name__ == "__main__":
    main()
