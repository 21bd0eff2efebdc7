"""`swiftlite estimate`: memory per GPU and per node's CPU for each ZeRO stage and offload
option, from the model's config.json alone, and the fastest configuration that fits.

    swiftlite estimate --model Qwen2-1.5B-Instruct --gpus 2 --gpu_memory 24GB --train_type full

The estimate itself is swiftlite.estimate.plan (`recommend` gives the same choice to code,
as sft's `--deepspeed auto` uses it); this module prints it.
"""
from __future__ import annotations

import json
import sys

from swiftlite.config.arguments import EstimateArguments
from swiftlite.config.constants import STAGES
from swiftlite.estimate.plan import recommend, run  # noqa: F401  (recommend: for code)



def _gb(n: int) -> str:
    return f"{n / 2**30:.2f}"


def table(result: dict) -> str:
    s = result["setup"]
    gpus = s["gpus_per_node"] * s["nodes"]
    quant = f", base in {s['quant_bits']} bits (QLoRA)" if s.get("quant_bits") else ""
    lines = [
        f"{result['model']}: {result['total_params'] / 1e9:.3f}B parameters, "
        f"{result['trainable_params'] / 1e6:,.2f}M trainable ({s['train_type']}), "
        f"{s['torch_dtype']}{quant}; {gpus} GPU{'s' if gpus > 1 else ''} x "
        f"{_gb(s['gpu_memory'])} GiB; "
        f"micro-batch {s['batch_size']} x {s['max_length']} tokens",
        "All figures GiB. GPU: per GPU (per process). CPU: per node. act: activations with "
        f"{'selective ' if s.get('selective_checkpointing') else ''}gradient checkpointing / "
        "without.",
        "",
        f"{'config':<14}{'params':>8}{'grads':>8}{'optim':>8}{'act':>8}{'act(no)':>9}"
        f"{'GPU':>8}{'GPU(no)':>9}{'CPU':>8}  fits",
    ]
    usable = s["gpu_memory"] * s["usable_fraction"]
    for r in result["rows"]:
        g = r["gpu"]
        fits = ("yes" if r["gpu_total_no_ckpt"] <= usable else "ckpt" if r["gpu_total"] <= usable
                else "no")
        if s["cpu_memory"] is not None and r["cpu_total"] > s["cpu_memory"]:
            fits = "no (CPU)"
        lines.append(f"{r['stage']:<14}{_gb(g['params']):>8}{_gb(g['grads']):>8}"
                     f"{_gb(g['optim']):>8}{_gb(g['activations']):>8}"
                     f"{_gb(g['activations_no_ckpt']):>9}{_gb(r['gpu_total']):>8}"
                     f"{_gb(r['gpu_total_no_ckpt']):>9}{_gb(r['cpu_total']):>8}  {fits:<5}"
                     f"   {STAGES[r['stage']]}")
    c = result["recommendation"]
    lines.append("")
    if c["fits"]:
        flags = (f"--deepspeed {c['deepspeed']}" if c["deepspeed"] else "no --deepspeed") + \
            f" --gradient_checkpointing {str(c['gradient_checkpointing']).lower()}" + \
            (f" --quant_bits {c['quant_bits']}" if c.get("quant_bits") else "")
        lines.append(f"Recommended: {flags}  ({c['reason']}).")
    else:
        lines.append(f"Nothing fits. {c['reason']}")
    lines.append(f"fits: yes = without gradient checkpointing, ckpt = only with it; "
                 f"{int(s['usable_fraction'] * 100)}% of each GPU is planned, the rest is "
                 "left to the CUDA context and fragmentation. Stages fastest first.")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    from swiftlite.config.argv import parse_argv
    args = parse_argv(EstimateArguments, argv, "swiftlite estimate",
                      "Estimate training memory per GPU and per node for each DeepSpeed ZeRO "
                      "stage and offload option, from the model's config.json alone.")
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else table(result))
    sys.stdout.flush()


__all__ = ["recommend", "run", "table", "main"]
