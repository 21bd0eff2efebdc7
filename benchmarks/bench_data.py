#!/usr/bin/env python3
"""Data at scale, side by side: launch -> first step and peak memory while preparing data.

  python benchmarks/bench_data.py --rows 200000 [--rows 1000000] [--tools swiftlite,llamafactory,msswift]
                               [--cases NAME,...] [--bench benchmarks/peers] [--out bench_data.jsonl]

For each row count: N seeded chat rows from the harness's make_data.py (seed 5), then 2
training steps of each case through the side-by-side harness in benchmarks/peers (its
run_<tool>.sh: same model, template, LoRA and batch settings; measure.py polls the memory of
the whole process tree). Cases:
  swiftlite     cold cache with --dataset_num_proc 1 and 2, the warm cache after them, --streaming
  llamafactory  preprocessing_num_workers unset (one process) and 2
  msswift       --dataset_num_proc 1 (its default) and 2
The harness has no knob for the peers' flags: the run scripts are copied to a scratch folder
and given one (an EXTRA line; each copy is checked to have taken it). One JSON line per case,
with the CPU model; run nothing else meanwhile (2 cores: anything else skews the figures).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu() -> str:
    with open("/proc/cpuinfo") as f:
        text = f.read()
    name = next(line.split(":", 1)[1].strip() for line in text.splitlines()
                if line.startswith("model name"))
    return name + (" (AMX)" if " amx_bf16" in text else " (no AMX)")


def harness_copy(bench: str, scratch: str) -> str:
    """The harness with an EXTRA hook in each peer's run script."""
    dst = os.path.join(scratch, "harness")
    shutil.copytree(bench, dst, ignore=shutil.ignore_patterns("results", "__pycache__"))
    patches = {"run_msswift.sh": ('--output_dir "$OUT" "${DS[@]}"',
                                  '--output_dir "$OUT" "${DS[@]}" ${EXTRA:-}'),
               "run_llamafactory.sh": ("seed: 42\n", "seed: 42\n${EXTRA:-}\n")}
    for name, (old, new) in patches.items():
        path = os.path.join(dst, name)
        text = open(path).read()
        if old not in text:
            sys.exit(f"{path}: the harness changed ({old!r} not found); update bench_data.py")
        open(path, "w").write(text.replace(old, new))
    return dst


def data_dir(harness: str, rows: int, model: str) -> str:
    """make_data.py's N rows (cached in /tmp); stats.json (only used by measure.py to
    estimate tokens when a tool reports none) from 512 rows, not by tokenising all N."""
    out = f"/tmp/bench_data_{rows}"
    if not os.path.exists(os.path.join(out, "train.jsonl")):
        subprocess.run([sys.executable, f"{harness}/make_data.py", "--out", out, "--n", str(rows),
                        "--seed", "5"], check=True)
    if not os.path.exists(os.path.join(out, "stats.json")):
        small = os.path.join(out, "stats512")
        subprocess.run([os.path.join(REPO, ".venv/bin/python"), f"{harness}/make_data.py",
                        "--out", small, "--n", "512", "--seed", "5", "--tokenizer", model,
                        "--max-length", "512"], check=True)
        shutil.copy(os.path.join(small, "stats.json"), os.path.join(out, "stats.json"))
    return out


def cases(tools: list[str], scratch: str, rows: int):
    """(tool, case name, EXTRA flags, extra env) in the order they run."""
    cache = os.path.join(scratch, f"swiftlite_cache_{rows}")
    for name, extra, fresh in (("cold_num_proc_1", "--dataset_num_proc 1", True),
                               ("cold_num_proc_2", "--dataset_num_proc 2", True),
                               ("warm", "--dataset_num_proc 2", False),
                               ("streaming", "--streaming true", False)):
        if "swiftlite" in tools:
            yield "swiftlite", name, extra, {"SWIFTLITE_CACHE": cache, "_fresh": fresh}
    if "llamafactory" in tools:
        yield "llamafactory", "workers_unset", "", {}
        yield "llamafactory", "workers_2", "preprocessing_num_workers: 2", {}
    if "msswift" in tools:
        yield "msswift", "num_proc_1", "--dataset_num_proc 1", {}
        yield "msswift", "num_proc_2", "--dataset_num_proc 2", {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, action="append", help="row counts (default 200000)")
    ap.add_argument("--tools", default="swiftlite,llamafactory,msswift")
    ap.add_argument("--cases", help="only these case names, comma-separated (e.g. workers_unset)")
    ap.add_argument("--bench", default=os.path.join(REPO, "benchmarks", "peers"))
    ap.add_argument("--model", default="/tmp/bench_models/smol135m")
    ap.add_argument("--out", default="bench_data.jsonl")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per case")
    a = ap.parse_args()
    tools = a.tools.split(",")
    scratch = tempfile.mkdtemp(prefix="bench_data_")
    harness = harness_copy(os.path.abspath(a.bench), scratch)
    if not os.path.exists(os.path.join(a.model, "model.safetensors")):
        subprocess.run([os.path.join(REPO, ".venv/bin/python"), f"{harness}/make_model.py",
                        a.model], check=True)
    for rows in a.rows or [200000]:
        data = data_dir(harness, rows, a.model)
        for tool, name, extra, env in cases(tools, scratch, rows):
            if a.cases and name not in a.cases.split(","):
                continue
            if env.pop("_fresh", False):
                shutil.rmtree(env["SWIFTLITE_CACHE"], ignore_errors=True)
            run_env = {**os.environ, **env, "DATA": data, "STEPS": "2", "MODEL": a.model,
                       "EXTRA": extra, "RESULTS": os.path.join(scratch, "results.jsonl"),
                       "RUNS": os.path.join(scratch, "runs"),
                       "MEASURE_TIMEOUT": str(a.timeout),
                       "SWIFTLITE": os.path.join(REPO, ".venv/bin/swiftlite")}
            r = subprocess.run(["bash", f"{harness}/run_{tool}.sh", f"{name}_{rows}"],
                               env=run_env, capture_output=True, text=True)
            lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
            result = json.loads(lines[-1]) if lines else {"rc": r.returncode,
                                                          "error": r.stderr[-2000:]}
            result.update(case=name, flags=extra, rows=rows, cpu=cpu(),
                          date=datetime.date.today().isoformat())
            line = json.dumps(result)
            print(line, flush=True)
            with open(a.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
