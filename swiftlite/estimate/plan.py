"""The estimate for one setup (every stage, and the fastest that fits), from
EstimateArguments; and those arguments derived from a training run's SftArguments, so that
sft's `--deepspeed auto` estimates exactly the run it is about to start."""
from __future__ import annotations

import dataclasses

from swiftlite.config.arguments import EstimateArguments
from swiftlite.config.sizes import parse_memory
from swiftlite.config.tuner_args import MUTATED_INIT
from swiftlite.estimate.memory import USABLE_FRACTION, Choice, estimate, model_spec
from swiftlite.estimate.memory import recommend as fastest_that_fits
from swiftlite.models.meta import read_config

# EstimateArguments fields that are no setting of the training run.
_HARDWARE = ("gpus", "nodes", "gpu_memory", "cpu_memory")
_OUTPUT = ("json",)


def sequences_per_row(rlhf_type: str | None) -> int:
    """Sequences trained per row of a batch: a preference pair is two (chosen, rejected)."""
    return 2 if rlhf_type in ("dpo", "orpo", "simpo", "cpo") else 1


def run(args: EstimateArguments) -> dict:
    """The estimate as a dict (what `swiftlite estimate --json` prints)."""
    args.validate()
    name, config = read_config(args.model)
    spec = model_spec(name, config, args.train_type, args.lora_rank, args.target_modules,
                      args.use_dora, args.modules_to_save)

    def rows_for(bits):
        return estimate(spec, gpus_per_node=args.gpus, nodes=args.nodes, dtype=args.torch_dtype,
                        train_type=args.train_type, max_length=args.max_length,
                        batch_size=args.batch_size * sequences_per_row(args.rlhf_type),
                        lora_dropout=args.lora_dropout,
                        chunked_loss=args.chunked_loss,
                        selective_checkpointing=args.selective_checkpointing,
                        quant_bits=bits, double_quant=args.bnb_4bit_use_double_quant,
                        zero3=not (args.use_dora or args.init_lora_weights.startswith(
                            MUTATED_INIT)))

    rows = rows_for(args.quant_bits)
    gpu_memory = parse_memory(args.gpu_memory, "gpu_memory")
    cpu_memory = parse_memory(args.cpu_memory, "cpu_memory") if args.cpu_memory else None
    gpus = args.gpus * args.nodes
    choice = fastest_that_fits(rows, gpu_memory, cpu_memory, gpus)
    if args.quant_bits is not None:
        choice.quant_bits = args.quant_bits
    elif args.train_type == "lora" and not args.init_lora_weights.startswith(MUTATED_INIT) and (
            not choice.fits or (choice.deepspeed or "").endswith("offload")):
        # (not for PiSSA/OLoRA, which decompose full-precision weights: sft refuses QLoRA)
        # The 16-bit base does not fit (or only with its weights streamed from the CPU):
        # QLoRA keeps it on the GPU: 4 bits first (bitsandbytes trains it faster than 8).
        for bits in (4, 8):
            q = fastest_that_fits(rows_for(bits), gpu_memory, cpu_memory, gpus)
            if q.fits and not (q.deepspeed or "").endswith("offload"):
                q.quant_bits = bits
                q.reason = (f"the {args.torch_dtype} base does not fit "
                            f"{'without offloading' if choice.fits else 'at all'}; QLoRA "
                            f"--quant_bits {bits} {q.reason}")
                choice = q
                break
    setup = {k: v for k, v in dataclasses.asdict(args).items()
             if k not in ("model", "gpus", *_OUTPUT)}
    setup.update(gpus_per_node=args.gpus, gpu_memory=gpu_memory, cpu_memory=cpu_memory,
                 usable_fraction=USABLE_FRACTION)
    return {"model": name, "total_params": spec.total_params,
            "trainable_params": spec.trainable_params,
            "largest_layer_params": spec.largest_layer_params, "setup": setup,
            "rows": [{"stage": r.stage, "gpu": r.gpu, "cpu": r.cpu,
                      "gpu_total": r.gpu_total, "gpu_total_no_ckpt": r.gpu_total_no_ckpt,
                      "cpu_total": r.cpu_total} for r in rows],
            "recommendation": choice.to_dict()}


def recommend(model_or_args, **fields) -> Choice:
    """The fastest configuration that fits, for code: `recommend(EstimateArguments(...))` or
    `recommend("Qwen2-7B", gpus=2, gpu_memory=24 * 2**30, ...)` with EstimateArguments fields
    (gpu_memory/cpu_memory as bytes or text such as "24GB"). Choice.deepspeed is a preset
    name or None (no DeepSpeed needed), Choice.gradient_checkpointing whether it must stay
    on, Choice.fits False when nothing fits (Choice.reason says what to change)."""
    if isinstance(model_or_args, EstimateArguments):
        args = dataclasses.replace(model_or_args, **fields)
    else:
        args = EstimateArguments(model=model_or_args, **fields)
    args.gpu_memory, args.cpu_memory = _text(args.gpu_memory), _text(args.cpu_memory)
    if not isinstance(args.target_modules, str):
        args.target_modules = list(args.target_modules)
    return Choice(**run(args)["recommendation"])


def for_training(sft_args, *, torch_dtype: str, **hardware) -> EstimateArguments:
    """EstimateArguments for the run these SftArguments (or RlhfArguments) describe: every
    field the two share by name is taken from the run (a field added to both is carried without
    a change here),
    the micro-batch from --per_device_train_batch_size, the dtype as resolved for the
    hardware, and the hardware figures (gpus, nodes, gpu_memory, cpu_memory) as given."""
    shared = {f.name for f in dataclasses.fields(EstimateArguments)} - set(_HARDWARE) \
        - set(_OUTPUT) - {"torch_dtype", "batch_size"}
    values = {name: getattr(sft_args, name) for name in shared if hasattr(sft_args, name)}
    return EstimateArguments(**values, torch_dtype=torch_dtype,
                             batch_size=sft_args.per_device_train_batch_size, **hardware)


def _text(v):
    return v if v is None or isinstance(v, str) else f"{int(v)}B"
