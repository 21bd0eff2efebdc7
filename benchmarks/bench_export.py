"""GGUF export: `swiftlite export` against llama.cpp's converter and quantizer run by hand on the
merged folder (the anchor), and the perplexity of each quant type. One JSON line per figure.

  python benchmarks/bench_export.py [--quant q4_k_m] [--skip ppl] [--ckpt_dir CKPT]
                                    [--layers N]

time: wall time and peak resident memory of the whole process tree (every child's RSS summed,
  sampled every 20 ms) of
    swiftlite-adapter  swiftlite export --ckpt_dir ADAPTER (merged by llama.cpp's converter as
                       it converts, export/converter_merge.py)
    swiftlite-adapter-bf16-base  the same from a bf16 copy of the base (--model), as the hub
                       stores SmolLM2 (the offline build here is fp32)
    swiftlite-merged   swiftlite export --ckpt_dir MERGED (llama.cpp's tools alone)
    anchor             convert_hf_to_gguf.py MERGED --outtype f16, then llama_model_quantize,
                       by hand, in the llama.cpp venv
  The adapter is a SmolLM2-135M-Instruct LoRA (the README's self-cognition recipe) unless
  --ckpt_dir names one; MERGED is it merged by swiftlite merge-lora in f16 (not timed).
  --layers N: instead, a SmolLM2-wide model of N layers (random bf16 weights) and a random
  LoRA on all its linear layers, to see how time and memory grow with the model.
ppl: perplexity of a held-out text through llama.cpp for each quant type of the base model,
  against transformers' fp32 model on the same tokens.

Needs scripts/setup_llamacpp.sh (the llama.cpp venv).
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.environ.get("SWIFTLITE_LLAMACPP_VENV") or os.path.join(REPO, ".venv-llamacpp")
LLAMA_PY = os.path.join(VENV, "bin", "python")
QUANTS = ("f16", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0")
TEXT = ("The history of bread is long. People ground wild grains between stones thousands of "
        "years before farming began, and mixed the flour with water to bake flat cakes on hot "
        "rocks. When farmers in the Fertile Crescent learned to grow wheat and barley, bread "
        "became a daily food. Egyptians noticed that dough left in the warm air would rise, "
        "because wild yeasts fed on its sugars and made gas; loaves became light and soft. "
        "Romans built large public bakeries with mills turned by donkeys, and bakers formed "
        "guilds that set prices and rules. In the Middle Ages, white bread was for the rich, "
        "while poor families ate dark loaves of rye or barley. The industrial age brought "
        "roller mills, cheap white flour and, later, sliced bread wrapped in paper. Today, many "
        "people bake again at home, and old methods such as sourdough are popular once more.")
QUANTIZE = ("import sys, llama_cpp\n"
            "p = llama_cpp.llama_model_quantize_default_params()\n"
            "p.ftype = getattr(llama_cpp, 'LLAMA_FTYPE_MOSTLY_' + sys.argv[3].upper())\n"
            "p.nthread = 2\n"
            "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), "
            "sys.argv[2].encode(), p))\n")
# llama.cpp's log-probs (with its AMX workaround): the export tests' helper, a standalone script
LLAMACPP_RUN = os.path.join(REPO, "tests", "helpers", "llamacpp_generate.py")


def emit(**rec):
    print(json.dumps({**rec, "load_avg_1m": round(os.getloadavg()[0], 1)}), flush=True)


def measured(cmds: list[list[str]]) -> tuple[float, float]:
    """Run the commands one after another: (wall seconds, peak MiB of the process tree's RSS)."""
    import psutil
    peak, t0 = 0, time.perf_counter()
    for cmd in cmds:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        done = threading.Event()

        def sample(p=psutil.Process(proc.pid)):
            nonlocal peak
            while not done.is_set():
                try:
                    tree = [p] + p.children(recursive=True)
                    peak = max(peak, sum(q.memory_info().rss for q in tree))
                except psutil.Error:
                    pass
                time.sleep(0.02)
        watcher = threading.Thread(target=sample, daemon=True)
        watcher.start()
        err = proc.communicate()[1]
        done.set()
        watcher.join()
        if proc.returncode != 0:
            sys.exit(f"{cmd[:3]} failed ({proc.returncode}):\n{err[-3000:]}")
    return time.perf_counter() - t0, peak / 2**20


def swiftlite(*args: str) -> list[str]:
    return [sys.executable, "-m", "swiftlite.cli", *args]


def adapter(work: str) -> str:
    """A SmolLM2 self-cognition LoRA checkpoint (the README's recipe, 4 steps)."""
    out = os.path.join(work, "train")
    subprocess.run(swiftlite("sft", "--model", "SmolLM2-135M-Instruct", "--dataset",
                             "self-cognition#32", "--model_name", "Swifty", "--model_author",
                             "Acme", "--max_steps", "4", "--per_device_train_batch_size", "8",
                             "--learning_rate", "2e-3", "--report_to", "none", "--output_dir",
                             out, "--add_version", "false"), check=True, capture_output=True)
    return os.path.join(out, "checkpoint-4")


def synthetic(work: str, layers: int) -> tuple[str, str]:
    """(a random LoRA checkpoint, its bf16 base): SmolLM2-135M-Instruct's shape and tokenizer
    with `layers` layers."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from swiftlite.models.registry import resolve_model
    src = resolve_model("SmolLM2-135M-Instruct")[0]
    config = AutoConfig.from_pretrained(src)
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    base = os.path.join(work, f"smollm2-{layers}-layers")
    model.save_pretrained(base)
    AutoTokenizer.from_pretrained(src).save_pretrained(base)
    ckpt = os.path.join(work, "random-lora")
    get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                     init_lora_weights=False)).save_pretrained(ckpt)
    with open(os.path.join(ckpt, "adapter_config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(ckpt, "adapter_config.json"), "w") as f:
        json.dump({**cfg, "base_model_name_or_path": base}, f)
    return ckpt, base


def bf16_copy(work: str) -> str:
    """SmolLM2-135M-Instruct stored in bf16, as on the hub."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swiftlite.models.registry import resolve_model
    src = resolve_model("SmolLM2-135M-Instruct")[0]
    out = os.path.join(work, "smollm2-bf16")
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


def bench_time(ckpt: str, quant: str, work: str, bf16_base: str | None) -> None:
    merged = os.path.join(work, "merged")
    subprocess.run(swiftlite("merge-lora", "--ckpt_dir", ckpt, "--output_dir", merged,
                             "--torch_dtype", "float16"), check=True, capture_output=True)
    size = sum(os.path.getsize(f) for f in glob.glob(os.path.join(merged, "*.safetensors")))
    share = os.path.join(VENV, "share", "llama.cpp")
    anchor = os.path.join(work, "anchor")
    os.makedirs(anchor)
    f16 = os.path.join(anchor, "model-f16.gguf")
    convert = [LLAMA_PY, os.path.join(share, "convert_hf_to_gguf.py"), merged, "--outfile"]
    runs = {
        "swiftlite-adapter": [swiftlite("export", "--ckpt_dir", ckpt, "--quant", quant,
                                        "--output_dir", os.path.join(work, "s-adapter"),
                                        "--llamacpp_venv", VENV)],
        **({"swiftlite-adapter-bf16-base": [swiftlite(
            "export", "--ckpt_dir", ckpt, "--model", bf16_base, "--quant", quant, "--output_dir",
            os.path.join(work, "s-adapter-bf16"), "--llamacpp_venv", VENV)]} if bf16_base else {}),
        "swiftlite-merged": [swiftlite("export", "--ckpt_dir", merged, "--quant", quant,
                                       "--output_dir", os.path.join(work, "s-merged"),
                                       "--llamacpp_venv", VENV)],
        "anchor": ([convert + [os.path.join(anchor, f"model-{quant}.gguf"), "--outtype", quant]]
                   if quant in ("f16", "bf16", "q8_0") else
                   [convert + [f16, "--outtype", "f16"],
                    [LLAMA_PY, "-c", QUANTIZE, f16, os.path.join(anchor, f"model-{quant}.gguf"),
                     quant]]),
    }
    for tool, cmds in runs.items():
        wall, peak = measured(cmds)
        emit(bench="export", tool=tool, quant=quant, wall_s=round(wall, 1),
             peak_rss_mib=round(peak), model_f16_mib=round(size / 2**20))


def bench_ppl(work: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swiftlite.models.registry import resolve_model
    base = resolve_model("SmolLM2-135M-Instruct")[0]
    ids = AutoTokenizer.from_pretrained(base)(TEXT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].double(), -1)
    ref = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    emit(bench="ppl", quant="fp32 (transformers)", tokens=len(ids), ppl=round(
        math.exp(-sum(ref) / len(ref)), 3))
    for quant in QUANTS:
        path = subprocess.run(swiftlite("export", "--model", base, "--quant", quant,
                                        "--output_dir", os.path.join(work, f"base-{quant}"),
                                        "--llamacpp_venv", VENV),
                              check=True, capture_output=True, text=True)
        gguf = glob.glob(os.path.join(work, f"base-{quant}", "*.gguf"))[0]
        job = os.path.join(work, f"logprobs-{quant}.json")
        with open(job, "w") as f:
            json.dump({"model": gguf, "logprobs": [ids]}, f)
        got = json.loads(subprocess.run([LLAMA_PY, LLAMACPP_RUN, job], check=True,
                                        capture_output=True, text=True
                                        ).stdout.strip().splitlines()[-1])["logprobs"][0]
        assert path.returncode == 0 and len(got) == len(ref)
        emit(bench="ppl", quant=quant, tokens=len(ids),
             ppl=round(math.exp(-sum(got) / len(got)), 3),
             mean_abs_logprob_diff=round(sum(abs(a - b) for a, b in zip(got, ref)) / len(ref), 4),
             file_mib=round(os.path.getsize(gguf) / 2**20, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quant", default="q4_k_m")
    ap.add_argument("--ckpt_dir", default=None)
    ap.add_argument("--skip", default="", help="time and/or ppl")
    ap.add_argument("--layers", type=int, default=0)
    a = ap.parse_args()
    sys.path.insert(0, REPO)
    from swiftlite.runtime.hardware import describe_cpu
    emit(bench="machine", cpu=describe_cpu(), date=time.strftime("%Y-%m-%d"))
    work = tempfile.mkdtemp(prefix="bench_export_")
    try:  # models, merges and GGUFs: gigabytes with --layers
        if "time" not in a.skip and a.layers:
            bench_time(synthetic(work, a.layers)[0], a.quant, work, None)
        elif "time" not in a.skip:
            bench_time(a.ckpt_dir or adapter(work), a.quant, work, bf16_copy(work))
        if "ppl" not in a.skip:
            bench_ppl(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
