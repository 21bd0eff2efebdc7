#!/usr/bin/env python3
"""Run a training command, poll the memory of its whole process tree, parse its log, print one JSON line.

  python3 measure.py --tool NAME [--log FILE] \
      [--stats data/stats.json --steps 30 --batch 4 --world 1] -- CMD ...

stdlib only. What it needs from the tool's output (HF-Trainer style, which both peers print):
  a per-step dict containing 'loss': X          -> final_loss (last one), first_step_s (time of first)
  a final dict containing 'train_runtime': S    -> train_s (the training loop, model load excluded)
  optionally 'num_input_tokens_seen': N         -> tokens (non-pad tokens, as counted by the tool)
Without a reported token count, tokens = mean tokens/sample (stats.json) * batch * world * steps.
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

PAGE = os.sysconf("SC_PAGE_SIZE")
NUM = r"['\"]?\s*:\s*'?([-+0-9.eE]+)"
RX = {k: re.compile(r"['\"]" + k + NUM) for k in ("loss", "train_runtime", "num_input_tokens_seen")}


def tree(root):
    """pids of root and all its descendants (from /proc)."""
    kids = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(p))
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def mem(pids):
    """(sum of RSS, sum of PSS) in bytes over pids."""
    rss = pss = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/statm") as f:
                rss += int(f.read().split()[1]) * PAGE
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
                        break
        except (OSError, ValueError, IndexError):
            pass
    return rss, pss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tool", required=True)
    ap.add_argument("--log", help="write the command's combined output here")
    ap.add_argument("--stats", help="stats.json from make_data.py --tokenizer")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--world", type=int, default=1, help="data-parallel processes")
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument("--timeout", type=float, default=0, help="kill the tree after this many seconds")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    logf = open(a.log, "w") if a.log else None

    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    peak = {"rss": 0, "pss": 0, "nproc": 0}
    done = threading.Event()

    def stop(*_):  # the tool runs in its own session: end its whole process group
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def poll():
        while not done.is_set():
            if a.timeout and time.time() - t0 > a.timeout:
                stop()
            pids = tree(proc.pid)
            rss, pss = mem(pids)
            peak["rss"], peak["pss"] = max(peak["rss"], rss), max(peak["pss"], pss)
            peak["nproc"] = max(peak["nproc"], len(pids))
            done.wait(a.interval)

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    res = {"loss": None, "train_runtime": None, "num_input_tokens_seen": None}
    first_step = None
    for line in proc.stdout:  # tqdm's \r updates arrive as part of lines; fine for regexes
        sys.stderr.write(line)  # progress to stderr; stdout carries only the JSON line
        if logf:
            logf.write(line)
        for k, rx in RX.items():
            for m in rx.finditer(line):
                try:
                    v = float(m.group(1))
                except ValueError:
                    continue
                res[k] = v
                if k == "loss" and first_step is None:
                    first_step = time.time() - t0
    rc = proc.wait()
    wall = time.time() - t0
    done.set()
    th.join()

    tokens, src = res["num_input_tokens_seen"], "reported"
    if tokens is None and a.stats:
        st = json.load(open(a.stats))
        tokens, src = st["mean"] * a.batch * a.world * a.steps, "estimated"
    train_s = res["train_runtime"]
    out = {"tool": a.tool, "rc": rc, "wall_s": round(wall, 2), "train_s": train_s,
           "first_step_s": round(first_step, 2) if first_step else None,
           "tokens": int(tokens) if tokens else None, "tokens_src": src if tokens else None,
           "tokens_per_s": round(tokens / train_s, 1) if tokens and train_s else None,
           "peak_rss_mb": round(peak["rss"] / 2**20), "peak_pss_mb": round(peak["pss"] / 2**20),
           "max_procs": peak["nproc"], "final_loss": res["loss"]}
    line = json.dumps(out)
    print(line, flush=True)
    if logf:
        logf.write(line + "\n")
        logf.close()
    sys.exit(rc)


if __name__ == "__main__":
    main()
