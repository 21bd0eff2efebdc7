"""Launch -> first step, cold and warm, for swiftlite and the peers (#42), one tool at a time.

    python benchmarks/bench_cold_start.py [--tools swiftlite msswift llamafactory] [--rounds 2]
                                          [--steps 3] [--out results.jsonl]

Each round runs every tool twice through benchmarks/peers/run_<tool>.sh (the peers' settings:
SmolLM2-135M, LoRA r8 all-linear, batch 4, max_length 512): first cold, then warm.

- cold: the page cache is emptied first, as after a minute of doing something else on these
  machines (the venvs, the model and the data are read from disk again). How, in the JSON's
  `evicted`: `drop_caches` (/proc/sys/vm/drop_caches, when writable: the whole cache) or
  `vmtouch` (Debian's `vmtouch -e` on the tool's venv, the model and the data).
- warm: right after the cold run, everything still cached.

swiftlite's rows say whether its read-ahead helper ran (`prefetch`; SWIFTLITE_PREFETCH=0 in the
environment turns it off, to measure it on and off).

Prints one JSON line per run (tool, round, cold/warm, first_step_s, wall_s, peak RSS, the CPU)
and appends it to --out. STEPS is small: the first step is what is measured.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = os.path.join(HERE, "peers")
REPO = os.path.dirname(HERE)
VENVS = os.environ.get("VENVS", "/tmp/bench_venvs")
MODEL = os.environ.get("MODEL", "/tmp/bench_models/smol135m")
DATA = os.environ.get("DATA", "/tmp/bench_data")


def cpu() -> dict:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = info.get("Flags", "").split()
    return {"cpu": info.get("Model name", "").strip(),
            "cpu_flags": [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags],
            "cores": os.cpu_count()}


def venv_of(tool: str) -> str:
    return os.path.join(REPO, ".venv") if tool == "swiftlite" else os.path.join(VENVS, tool)


def evict(tool: str) -> str:
    """Empty the page cache of what `tool` reads at start; returns how."""
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            os.sync()
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    if shutil.which("vmtouch"):
        subprocess.run(["vmtouch", "-q", "-e", venv_of(tool), MODEL, DATA], check=True)
        return "vmtouch"
    sys.exit("cannot empty the page cache: /proc/sys/vm/drop_caches is not writable and vmtouch "
             "is missing (apt-get install vmtouch)")


def run_tool(tool: str, tag: str, steps: int) -> dict:
    env = {**os.environ, "STEPS": str(steps),
           "RESULTS": os.path.join("/tmp/bench_runs", "cold_start_raw.jsonl")}
    if tool == "swiftlite":
        env["SWIFTLITE"] = os.path.join(venv_of(tool), "bin", "swiftlite")
    r = subprocess.run(["bash", os.path.join(PEERS, f"run_{tool}.sh"), tag], env=env,
                       capture_output=True, text=True)
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    if r.returncode or not lines:
        sys.exit(f"run_{tool}.sh failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tools", nargs="+", default=["swiftlite", "msswift", "llamafactory"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="/tmp/bench_runs/cold_start.jsonl")
    a = ap.parse_args()
    machine = cpu()
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    for rnd in range(1, a.rounds + 1):
        for tool in a.tools:
            for state in ("cold", "warm"):
                how = evict(tool) if state == "cold" else None
                time.sleep(1)
                m = run_tool(tool, f"{state}{rnd}", a.steps)
                row = {"tool": tool, "round": rnd, "start": state, "evicted": how,
                       "first_step_s": m.get("first_step_s"), "wall_s": m.get("wall_s"),
                       "peak_rss_mb": m.get("peak_rss_mb"), "steps": a.steps, **machine,
                       **({"prefetch": os.environ.get("SWIFTLITE_PREFETCH") != "0"}
                          if tool == "swiftlite" else {}),
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
                print(json.dumps(row), flush=True)
                with open(a.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
