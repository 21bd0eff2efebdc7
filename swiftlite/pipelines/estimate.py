"""`swiftlite estimate`: memory per GPU and per node's CPU for each ZeRO stage and offload
option, from the model's config.json alone, and the fastest configuration that fits.

    swiftlite estimate --model Qwen2-1.5B-Instruct --gpus 2 --gpu_memory 24GB --train_type full

`recommend(...)` gives the same choice to code (sft's `--deepspeed auto`).
"""
from __future__ import annotations

import json
import sys

from ..arguments import EstimateArguments
from ..parsing import build
from ..memory import (STAGES, USABLE_FRACTION, Choice, estimate, model_spec, parse_memory,
                      read_config, recommend as _recommend)

_STAGE_NOTES = {"none": "no DeepSpeed (DDP on several GPUs)", "zero0": "DeepSpeed, nothing "
                "partitioned", "zero1": "optimizer states partitioned",
                "zero2": "+ gradients partitioned", "zero2_offload": "optimizer on CPU",
                "zero3": "+ parameters partitioned", "zero3_offload": "parameters and optimizer "
                "on CPU"}


def run(args: EstimateArguments) -> dict:
    """The estimate as a dict (what --json prints)."""
    args.validate()
    name, config = read_config(args.model)
    spec = model_spec(name, config, args.train_type, args.lora_rank, args.target_modules)
    rows = estimate(spec, gpus_per_node=args.gpus, nodes=args.nodes, dtype=args.torch_dtype,
                    train_type=args.train_type, max_length=args.max_length,
                    batch_size=args.batch_size, lora_dropout=args.lora_dropout,
                    chunked_loss=args.chunked_loss,
                    selective_checkpointing=args.selective_checkpointing)
    gpu_memory = parse_memory(args.gpu_memory, "gpu_memory")
    cpu_memory = parse_memory(args.cpu_memory, "cpu_memory") if args.cpu_memory else None
    choice = _recommend(rows, gpu_memory, cpu_memory, args.gpus * args.nodes)
    return {"model": name, "total_params": spec.total_params,
            "trainable_params": spec.trainable_params,
            "largest_layer_params": spec.largest_layer_params,
            "setup": {"gpus_per_node": args.gpus, "nodes": args.nodes, "gpu_memory": gpu_memory,
                      "cpu_memory": cpu_memory, "torch_dtype": args.torch_dtype,
                      "train_type": args.train_type, "max_length": args.max_length,
                      "batch_size": args.batch_size, "chunked_loss": args.chunked_loss,
                      "selective_checkpointing": args.selective_checkpointing,
                      "usable_fraction": USABLE_FRACTION},
            "rows": [{"stage": r.stage, "gpu": r.gpu, "cpu": r.cpu,
                      "gpu_total": r.gpu_total, "gpu_total_no_ckpt": r.gpu_total_no_ckpt,
                      "cpu_total": r.cpu_total} for r in rows],
            "recommendation": choice.to_dict()}


def recommend(model: str, *, gpus: int = 1, nodes: int = 1, gpu_memory="24GB",
              cpu_memory=None, train_type: str = "lora", max_length: int = 2048,
              batch_size: int = 1, torch_dtype: str = "bfloat16", lora_rank: int = 8,
              target_modules=("all-linear",), chunked_loss: bool = True,
              selective_checkpointing: bool = False) -> Choice:
    """The fastest configuration that fits, for code (sft's `--deepspeed auto`):
    Choice.deepspeed is a preset name or None (no DeepSpeed needed),
    Choice.gradient_checkpointing whether it must stay on, Choice.fits False when nothing
    fits (Choice.reason says what to change). gpu_memory/cpu_memory: bytes (int) or text
    such as "24GB"; gpus: processes per node."""
    def size(v):
        return v if v is None or isinstance(v, str) else f"{int(v)}B"
    args = EstimateArguments(model=model, gpus=gpus, nodes=nodes, gpu_memory=size(gpu_memory),
                             cpu_memory=size(cpu_memory), train_type=train_type,
                             max_length=max_length, batch_size=batch_size,
                             torch_dtype=torch_dtype, lora_rank=lora_rank,
                             target_modules=target_modules if isinstance(
                                 target_modules, str) else list(target_modules), chunked_loss=chunked_loss,
                             selective_checkpointing=selective_checkpointing)
    return Choice(**run(args)["recommendation"])


def _gb(n: int) -> str:
    return f"{n / 2**30:.2f}"


def table(result: dict) -> str:
    s = result["setup"]
    gpus = s["gpus_per_node"] * s["nodes"]
    lines = [
        f"{result['model']}: {result['total_params'] / 1e9:.3f}B parameters, "
        f"{result['trainable_params'] / 1e6:,.2f}M trainable ({s['train_type']}), "
        f"{s['torch_dtype']}; {gpus} GPU{'s' if gpus > 1 else ''} x {_gb(s['gpu_memory'])} GiB; "
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
                     f"   {_STAGE_NOTES[r['stage']]}")
    c = result["recommendation"]
    lines.append("")
    if c["fits"]:
        flags = (f"--deepspeed {c['deepspeed']}" if c["deepspeed"] else "no --deepspeed") + \
            f" --gradient_checkpointing {str(c['gradient_checkpointing']).lower()}"
        lines.append(f"Recommended: {flags}  ({c['reason']}).")
    else:
        lines.append(f"Nothing fits. {c['reason']}")
    lines.append(f"fits: yes = without gradient checkpointing, ckpt = only with it; "
                 f"{int(s['usable_fraction'] * 100)}% of each GPU is planned, the rest is "
                 "left to the CUDA context and fragmentation. Stages fastest first.")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    from ..cli import parse_argv
    args = parse_argv(EstimateArguments, argv, "swiftlite estimate",
                      "Estimate training memory per GPU and per node for each DeepSpeed ZeRO "
                      "stage and offload option, from the model's config.json alone.")
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else table(result))
    sys.stdout.flush()


__all__ = ["STAGES", "recommend", "run", "table", "main", "build"]
