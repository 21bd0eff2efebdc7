"""Preference training (DPO, sigmoid, beta 0.1) side by side: swiftlite rlhf, LLaMA-Factory
(stage: dpo), ms-swift (swift rlhf --rlhf_type dpo) and TRL's DPOTrainer with peft, each from
its own venv (benchmarks/peers/install_peers.sh; TRL: VENVS/trl with trl and peft), one tool
at a time, with the peers' SFT settings: SmolLM2-135M-Instruct, LoRA r8/alpha 32/dropout 0.05
on all linear layers, batch 4 pairs, max_length 512, 30 steps, gradient checkpointing.

  .venv/bin/python benchmarks/bench_rlhf.py [--tools swiftlite,llamafactory,msswift,trl]
        [--steps 30] [--out /tmp/bench_rlhf/results.jsonl]

Each run prints one JSON line: measure.py's figures (wall, launch -> first step, peak RSS of
the process tree) plus pairs_per_s (steps x batch / the tool's train_runtime) and
heldout_accuracy: on 64 held-out pairs, the share whose implicit reward margin
(log-ratio to the base of chosen minus rejected) is positive under the tool's saved adapter,
computed here with plain transformers + peft (the same learning check for every tool).

The pairs: each sample of the harness' SFT data (benchmarks/peers/make_data.py) with its own
reply as chosen and another sample's reply as rejected, written in each tool's own layout.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = os.path.join(HERE, "peers")
BATCH, HELD_OUT = 4, 64


def make_pairs(data_dir: str, out: str) -> dict:
    """Pairs from the harness' SFT samples, in every tool's layout; the held-out ones apart."""
    rows = [json.loads(line) for line in open(os.path.join(data_dir, "train.jsonl"))]
    rng = random.Random(0)
    replies = [r["messages"][-1]["content"] for r in rows]
    pairs = []
    for i, r in enumerate(rows):
        j = (i + rng.randint(1, len(rows) - 1)) % len(rows)
        pairs.append({"prompt": r["messages"][:-1], "chosen": replies[i], "rejected": replies[j]})
    held, train = pairs[:HELD_OUT], pairs[HELD_OUT:]
    os.makedirs(out, exist_ok=True)

    def write(name, items):
        with open(os.path.join(out, name), "w") as f:
            for x in items:
                f.write(json.dumps(x, ensure_ascii=False) + "\n")
        return os.path.join(out, name)

    paths = {"heldout": write("heldout.jsonl", held)}
    paths["trl"] = write("pairs_trl.jsonl", [
        {"prompt": p["prompt"], "chosen": [{"role": "assistant", "content": p["chosen"]}],
         "rejected": [{"role": "assistant", "content": p["rejected"]}]} for p in train])
    paths["swift"] = write("pairs_swift.jsonl", [
        {"messages": p["prompt"] + [{"role": "assistant", "content": p["chosen"]}],
         "rejected_response": p["rejected"]} for p in train])
    paths["lf"] = write("pairs_lf.jsonl", [
        {"system": p["prompt"][0]["content"],
         "conversations": [{"from": "human", "value": p["prompt"][1]["content"]}],
         "chosen": {"from": "gpt", "value": p["chosen"]},
         "rejected": {"from": "gpt", "value": p["rejected"]}} for p in train])
    with open(os.path.join(out, "dataset_info.json"), "w") as f:
        json.dump({"bench_dpo": {"file_name": "pairs_lf.jsonl", "formatting": "sharegpt",
                                 "ranking": True, "columns": {
                                     "messages": "conversations", "system": "system",
                                     "chosen": "chosen", "rejected": "rejected"}}}, f)
    return paths


COMMON = dict(lr="5e-5", beta="0.1")


def command(tool: str, a, paths: dict, out: str) -> list[str]:
    steps = str(a.steps)
    if tool == "swiftlite":
        return [os.path.join(os.path.dirname(sys.executable), "swiftlite"), "rlhf",
                "--rlhf_type", "dpo", "--beta", COMMON["beta"], "--model", a.model,
                "--template", "chatml", "--dataset", paths["trl"], "--lora_rank", "8",
                "--lora_alpha", "32", "--lora_dropout", "0.05", "--max_length", "512",
                "--per_device_train_batch_size", str(BATCH), "--gradient_accumulation_steps",
                "1", "--learning_rate", COMMON["lr"], "--lr_scheduler_type", "cosine",
                "--warmup_ratio", "0", "--weight_decay", "0.1", "--max_steps", steps,
                "--logging_steps", "1", "--save_steps", steps, "--report_to", "none",
                "--seed", "42", "--output_dir", out, "--add_version", "false"]
    if tool == "msswift":
        return [os.path.join(a.venvs, "msswift", "bin", "swift"), "rlhf", "--rlhf_type", "dpo",
                "--beta", COMMON["beta"], "--model", a.model, "--model_type", "llama",
                "--template", "chatml", "--tuner_type", "lora", "--dataset", paths["swift"],
                "--torch_dtype", "float32", "--lora_rank", "8", "--lora_alpha", "32",
                "--lora_dropout", "0.05", "--target_modules", "all-linear", "--max_length",
                "512", "--per_device_train_batch_size", str(BATCH),
                "--gradient_accumulation_steps", "1", "--learning_rate", COMMON["lr"],
                "--lr_scheduler_type", "cosine", "--warmup_ratio", "0", "--weight_decay",
                "0.1", "--max_steps", steps, "--gradient_checkpointing", "true",
                "--eval_strategy", "no", "--save_steps", steps, "--logging_steps", "1",
                "--report_to", "none", "--dataloader_num_workers", "0", "--seed", "42",
                "--output_dir", out, "--add_version", "false"]
    if tool == "llamafactory":
        yaml = out + ".yaml"
        with open(yaml, "w") as f:
            f.write("\n".join(f"{k}: {v}" for k, v in {
                "model_name_or_path": a.model, "stage": "dpo", "do_train": "true",
                "finetuning_type": "lora", "lora_rank": 8, "lora_alpha": 32,
                "lora_dropout": 0.05, "lora_target": "all", "pref_beta": COMMON["beta"],
                "pref_loss": "sigmoid", "dataset": "bench_dpo",
                "dataset_dir": os.path.dirname(paths["lf"]), "template": "chatml",
                "cutoff_len": 512, "overwrite_cache": "true", "output_dir": out,
                "logging_steps": 1, "save_steps": a.steps, "report_to": "none",
                "per_device_train_batch_size": BATCH, "gradient_accumulation_steps": 1,
                "learning_rate": COMMON["lr"], "lr_scheduler_type": "cosine",
                "warmup_ratio": 0.0, "weight_decay": 0.1, "max_steps": a.steps,
                "bf16": "false", "fp16": "false", "dataloader_num_workers": 0,
                "seed": 42}.items()) + "\n")
        return [os.path.join(a.venvs, "llamafactory", "bin", "llamafactory-cli"), "train", yaml]
    if tool == "trl":
        return [os.path.join(a.venvs, "trl", "bin", "python"),
                os.path.join(HERE, "peers", "run_trl_dpo.py"), a.model, paths["trl"], out,
                steps, str(BATCH), COMMON["lr"], COMMON["beta"]]
    raise SystemExit(f"unknown tool {tool}")


def find_adapter(out: str) -> str | None:
    for root, _, files in sorted(os.walk(out), key=lambda x: -len(x[0])):
        if "adapter_model.safetensors" in files:
            return root
    return None


def heldout_accuracy(model_dir: str, adapter: str, heldout: str) -> float:
    """Share of held-out pairs whose reward margin under the adapter is positive (plain
    transformers + peft, the tokenizer's own chat template)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in open(heldout)]

    def logps(model):
        out = []
        for r in rows:
            vals = []
            for reply in (r["chosen"], r["rejected"]):
                p = tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
                full = tok.apply_chat_template(r["prompt"] + [{"role": "assistant",
                                                               "content": reply}], tokenize=False)
                n = len(tok(p, add_special_tokens=False)["input_ids"])
                ids = torch.tensor([tok(full, add_special_tokens=False)["input_ids"][:512]])
                with torch.no_grad():
                    lp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
                vals.append(lp[n - 1:].gather(1, ids[0, n:, None]).sum().item())
            out.append(vals[0] - vals[1])
        return out

    before = logps(base)
    after = logps(PeftModel.from_pretrained(base, adapter).eval())
    return sum(a > b for a, b in zip(after, before)) / len(rows)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tools", default="swiftlite,llamafactory,msswift,trl")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--model", default="/tmp/bench_models/smol135m")
    p.add_argument("--data", default="/tmp/bench_data")
    p.add_argument("--venvs", default=os.environ.get("VENVS", "/tmp/bench_venvs"))
    p.add_argument("--runs", default="/tmp/bench_rlhf")
    p.add_argument("--out", default="/tmp/bench_rlhf/results.jsonl")
    a = p.parse_args()
    if not os.path.exists(os.path.join(a.model, "config.json")):
        subprocess.run([sys.executable, os.path.join(PEERS, "make_model.py"), a.model], check=True)
    if not os.path.exists(os.path.join(a.data, "train.jsonl")):
        subprocess.run([sys.executable, os.path.join(PEERS, "make_data.py"), "--out", a.data,
                        "--tokenizer", a.model, "--max-length", "512"], check=True)
    paths = make_pairs(a.data, os.path.join(a.runs, "data"))
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count()), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "WANDB_DISABLED": "true"}
    for tool in a.tools.split(","):
        out = os.path.join(a.runs, tool)
        subprocess.run(["rm", "-rf", out])
        cmd = command(tool, a, paths, out)
        r = subprocess.run([sys.executable, os.path.join(PEERS, "measure.py"), "--tool", tool,
                            "--log", out + ".log", "--steps", str(a.steps), "--batch",
                            str(BATCH), "--", *cmd], env=env, stdout=subprocess.PIPE, text=True)
        row = json.loads(r.stdout.strip().splitlines()[-1])
        row["pairs_per_s"] = round(a.steps * BATCH / row["train_s"], 3) if row["train_s"] else None
        adapter = find_adapter(out)
        row["heldout_accuracy"] = heldout_accuracy(a.model, adapter, paths["heldout"]) \
            if adapter else None
        row.update(cpu=_cpu(), steps=a.steps, batch_pairs=BATCH)
        line = json.dumps(row)
        print(line, flush=True)
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "a") as f:
            f.write(line + "\n")


def _cpu() -> str:
    name, flags = "?", set()
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return name + ": " + " ".join(f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2")
                                  if f in flags)


if __name__ == "__main__":
    main()
