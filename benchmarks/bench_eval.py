"""Evaluation throughput on one custom QA file: `swiftlite eval` (pt and vLLM backends) against
ms-swift's `swift eval` (EvalScope's general_qa). One JSON line per tool.

  python benchmarks/bench_eval.py [--rows 64] [--max_new_tokens 64] [--tools swiftlite-pt,...]

Every tool answers the same questions (chat rows; the reference is the last assistant
message) greedily with the same model (SmolLM2-135M-Instruct, fp32) and at most
--max_new_tokens tokens, 16 rows at a time, and scores them with ROUGE/BLEU. Figures: the wall
time of the whole command as a user runs it (start-up, model load, generation, scoring), rows
per second over that, and for swiftlite the generation time it logs ("answers generated in").
The answers' mean length in tokens is reported too: rows/s compares tools only when their
answers are about as long.

The peers' venvs: benchmarks/peers/install_peers.sh msswift, then in that venv
  pip install evalscope==1.10.0 "numpy>=2" "setuptools<81"   (ms-swift 4.6 needs EvalScope's
      EvalType.SERVICE, gone from 1.11)
  pip install --no-deps ms-opencompass                        (its numpy<2 pin breaks the venv)
  pip install mmengine scikit-learn evaluate rank_bm25 sentence_transformers fuzzywuzzy h5py
      (what ms-opencompass imports when ms-swift lists the datasets)
vLLM: scripts/setup_vllm.sh.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOPICS = ["the sea", "volcanoes", "bees", "the moon", "rain", "coffee", "chess", "bicycles",
          "libraries", "glaciers", "owls", "bread", "trains", "deserts", "violins", "maps"]
ASKS = ["Tell me one fact about {}.", "Why do people like {}?", "Describe {} in one sentence.",
        "What is a common mistake people make about {}?"]


def questions(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        q = ASKS[(i // len(TOPICS)) % len(ASKS)].format(TOPICS[i % len(TOPICS)])
        rows.append({"messages": [{"role": "user", "content": q},
                                  {"role": "assistant", "content": f"A short answer about "
                                                                   f"{TOPICS[i % len(TOPICS)]}."}]})
    return rows


def timed(cmd: list[str], env: dict, log: str) -> tuple[float, str]:
    t0 = time.perf_counter()  # in the log's folder: ms-swift writes ./result there, not here
    r = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                       cwd=os.path.dirname(log))
    took = time.perf_counter() - t0
    with open(log, "w") as f:
        f.write(shlex.join(cmd) + "\n" + r.stdout + r.stderr)
    if r.returncode != 0:
        sys.exit(f"{cmd[0]} failed ({r.returncode}); see {log}")
    return took, r.stdout + r.stderr


def swiftlite(backend: str, model: str, data: str, work: str, a) -> dict:
    out = os.path.join(work, f"swiftlite-{backend}")
    cmd = [sys.executable, "-m", "swiftlite.cli", "eval", "--model", model, "--eval_dataset",
           data, "--max_new_tokens", str(a.max_new_tokens), "--max_batch_size", "16",
           "--torch_dtype", "float32", "--eval_loss", "false", "--output_dir", out]
    env = {}
    if backend == "vllm":
        cmd += ["--infer_backend", "vllm", "--vllm_python", os.environ.get(
                    "SWIFTLITE_VLLM_PYTHON", os.path.join(REPO, ".venv-vllm", "bin", "python")),
                "--max_model_len", "1024",
                "--vllm_args=--enforce-eager --distributed-executor-backend uni"]
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    wall, log = timed(cmd, env, out + ".log")
    gen = float(re.search(r"answers generated in ([\d.]+) s", log).group(1))
    preds = [json.loads(x) for x in open(os.path.join(out, "predictions.jsonl"))]
    return {"tool": f"swiftlite-{backend}", "wall_s": round(wall, 1), "generate_s": gen,
            "rows": len(preds), "rows_per_s": round(len(preds) / wall, 3),
            "generate_rows_per_s": round(len(preds) / gen, 3),
            "mean_tokens": round(sum(p["tokens"] for p in preds) / len(preds), 1)}


def msswift(model: str, rows: list[dict], work: str, a) -> dict:
    from transformers import AutoTokenizer
    folder = os.path.join(work, "general_qa")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "qa.jsonl"), "w") as f:  # general_qa's messages layout
        for r in rows:
            f.write(json.dumps({"messages": r["messages"][:-1],
                                "answer": r["messages"][-1]["content"]}) + "\n")
    out = os.path.join(work, "msswift")
    cmd = [os.path.join(a.venvs, "msswift", "bin", "swift"), "eval", "--model", model,
           "--model_type", "llama", "--template", "chatml",  # as peers/run_msswift.sh
           "--eval_backend", "Native", "--infer_backend", "transformers",
           "--eval_dataset", "general_qa", "--eval_dataset_args",
           json.dumps({"general_qa": {"local_path": folder, "subset_list": ["qa"],
                                      # its BLEU needs nltk data from the network
                                      "metric_list": ["Rouge"]}}),
           "--eval_generation_config", json.dumps({"max_tokens": a.max_new_tokens,
                                                   "temperature": 0}),
           "--torch_dtype", "float32", "--max_batch_size", "16", "--eval_output_dir", out]
    wall, _ = timed(cmd, {"HF_HUB_OFFLINE": "1"}, out + ".log")
    tok = AutoTokenizer.from_pretrained(model)
    answers = [json.loads(x) for f in glob.glob(f"{out}/**/predictions/**/*.jsonl",
                                                recursive=True) for x in open(f)]
    texts = [_prediction(p) for p in answers]
    return {"tool": "ms-swift", "wall_s": round(wall, 1), "rows": len(texts),
            "rows_per_s": round(len(texts) / wall, 3),
            "mean_tokens": round(sum(len(tok(t)["input_ids"]) for t in texts)
                                 / max(len(texts), 1), 1)}


def _prediction(p: dict) -> str:
    """The answer text in an EvalScope predictions line (its layout changes between
    versions: look for the model output's message content)."""
    out = p.get("model_output") or {}
    for choice in out.get("choices") or []:
        content = (choice.get("message") or {}).get("content")
        if isinstance(content, str):
            return content
    return str(p.get("prediction") or "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max_new_tokens", type=int, default=64)
    ap.add_argument("--tools", default="swiftlite-pt,swiftlite-vllm,ms-swift")
    ap.add_argument("--model", default=None, help="a model folder (default: swiftlite's "
                    "SmolLM2-135M-Instruct)")
    ap.add_argument("--venvs", default=os.environ.get("VENVS", "/tmp/bench_venvs"))
    a = ap.parse_args()
    sys.path.insert(0, REPO)
    from swiftlite.models.registry import resolve_model
    from swiftlite.runtime.hardware import describe_cpu
    model = a.model or resolve_model("SmolLM2-135M-Instruct")[0]
    work = tempfile.mkdtemp(prefix="bench_eval_")
    rows = questions(a.rows)
    data = os.path.join(work, "qa.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    for tool in a.tools.split(","):
        if tool.startswith("swiftlite-"):
            rec = swiftlite(tool.split("-", 1)[1], model, data, work, a)
        elif tool == "ms-swift":
            rec = msswift(model, rows, work, a)
        else:
            sys.exit(f"unknown tool {tool}")
        print(json.dumps({**rec, "max_new_tokens": a.max_new_tokens, "cpu": describe_cpu(),
                          "load_avg_1m": round(os.getloadavg()[0], 1),
                          "date": time.strftime("%Y-%m-%d")}), flush=True)


if __name__ == "__main__":
    main()
