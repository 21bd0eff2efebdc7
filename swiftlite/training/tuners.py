"""LoRA through peft (or full fine-tuning), ready for gradient checkpointing."""
from __future__ import annotations

from swiftlite.log import info
from swiftlite.models.targets import peft_target


def prepare_model(model, args, device: str | None = None, adapter: str | None = None):
    """Wrap `model` for training per args.train_type; returns the model to train. `device`:
    where it will train ("cpu", "cuda", "npu"); by default where its weights are now (the
    Trainer moves a model loaded on the CPU to the GPU only later). `adapter`: a LoRA
    checkpoint whose adapters go on training (its rank and targets, not the arguments')."""
    from swiftlite.training import speedups
    device = device or next(model.parameters()).device.type
    plan = speedups.plan(model, args, device)
    if args.gradient_checkpointing:
        # Non-reentrant checkpointing gives gradients to LoRA weights without needing the
        # inputs to require grad, and recomputes each layer's forward exactly once.
        kwargs = speedups.checkpoint_kwargs(plan)
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # Training never uses the KV cache, and with it on transformers skips the per-sample mask of
    # padding-free batches (samples would attend to each other): off, with or without checkpointing.
    model.config.use_cache = False
    if args.train_type == "full":
        speedups.apply(model, plan)
        info(f"full fine-tuning: {_count(model)} trainable parameters")
        return model
    from peft import PeftModel, get_peft_model

    from swiftlite.training import lora_variants
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter, is_trainable=True)
        config = model.peft_config["default"]
        info(f"LoRA adapters from {adapter} (r={config.r}, alpha={config.lora_alpha}) go on "
             "training")
    else:
        config = lora_variants.lora_config(args, model)
        try:
            model = get_peft_model(model, config)
        except ValueError as e:
            from swiftlite.errors import UsageError
            raise UsageError(f"--target_modules {' '.join(args.target_modules)}: {e}") from None
        lora_variants.warn_unmergeable_bias(model, config)
        lora_variants.quiet_bias_shape_warning(model, config)
        if lora_variants.mutated_init(config):
            lora_variants.save_converted(model)
    # DeepSpeed on a GPU casts the model to its 16-bit dtype itself, with fp32 master weights
    if not (getattr(args, "deepspeed", None) and device != "cpu"):
        cast = lora_variants.train_copies_in_fp32(model, device != "cpu" or plan.fp32_activations)
        if cast and adapter is not None:
            lora_variants.reload_copies(model, adapter)  # loaded through the base's 16 bits
    speedups.apply(model, plan)
    # peft counts a 4-bit parameter as the weights it packs, not its bytes
    trainable, total = model.get_nb_trainable_parameters() if not zero3_partitioned(model) \
        else (_count(model), _count(model, trainable_only=False))
    target = config.target_modules if adapter is not None else peft_target(args.target_modules)
    info(f"LoRA r={config.r} alpha={config.lora_alpha}{lora_variants.describe(config, model)} on "
         f"{target}: {trainable:,} trainable of {total:,} parameters "
         f"({100 * trainable / total:.3f}%)")
    return model


def zero3_partitioned(model) -> bool:
    return hasattr(next(model.parameters()), "ds_id")


def _count(model, trainable_only: bool = True) -> int:
    # ZeRO-3 loads partitioned: a parameter's full size is then ds_numel, numel() is 0.
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()
               if p.requires_grad or not trainable_only)
