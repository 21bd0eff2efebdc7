"""LoRA through peft (or full fine-tuning), ready for gradient checkpointing."""
from __future__ import annotations

from .log import info

ALL_LINEAR = "all-linear"  # peft's shorthand: every linear layer except the output layer


def is_all_linear(targets) -> bool:
    """--target_modules all-linear (as a string or a one-item list)."""
    return targets == ALL_LINEAR or (not isinstance(targets, str) and list(targets) == [ALL_LINEAR])


def prepare_model(model, args, device: str | None = None):
    """Wrap `model` for training per args.train_type; returns the model to train. `device`:
    where it will train ("cpu", "cuda", "npu"); by default where its weights are now (the
    Trainer moves a model loaded on the CPU to the GPU only later)."""
    first = next(model.parameters())
    device = device or first.device.type
    # Fused LoRA layers on CPUs only (GPUs keep peft's layers under autocast), and not on
    # ZeRO-3's partitioned weights, which DeepSpeed gathers through the modules' hooks.
    fused = (args.train_type == "lora" and getattr(args, "fused_lora", True) and device == "cpu"
             and not hasattr(first, "ds_id"))
    selective = args.gradient_checkpointing and getattr(args, "selective_checkpointing", False)
    if selective and args.train_type == "full":
        from .log import warn
        warn("--selective_checkpointing keeps the outputs of frozen matmuls, and full "
             "fine-tuning trains every weight: nothing to keep, so plain gradient checkpointing.")
        selective = False
    if args.gradient_checkpointing:
        # Non-reentrant checkpointing gives gradients to LoRA weights without needing the
        # inputs to require grad, and recomputes each layer's forward exactly once.
        from .checkpointing import checkpoint_kwargs
        # Selective checkpointing: fused LoRA layers keep their frozen outputs themselves
        # (fused_lora.keep_frozen_outputs); otherwise torch's policy-based version.
        kwargs = checkpoint_kwargs(selective and not fused)
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # Training never uses the KV cache, and with it on transformers skips the per-sample mask of
    # padding-free batches (samples would attend to each other): off, with or without checkpointing.
    model.config.use_cache = False
    if getattr(args, "padding_free", False) and not getattr(args, "attn_impl", None):
        # SDPA per packed sample instead of one block-diagonal mask (same numbers, ~4x less
        # attention work at batch 4); --attn_impl sdpa keeps the stock implementation.
        from .packed_attention import use_packed_attention
        use_packed_attention(model)
    if args.train_type == "full":
        info(f"full fine-tuning: {_count(model)} trainable parameters")
        return model
    from peft import LoraConfig, get_peft_model
    targets = args.target_modules
    target = ALL_LINEAR if is_all_linear(targets) else targets
    config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha,
                        lora_dropout=args.lora_dropout, target_modules=target,
                        task_type="CAUSAL_LM")
    try:
        model = get_peft_model(model, config)
    except ValueError as e:
        from .errors import UsageError
        raise UsageError(f"--target_modules {' '.join(targets)}: {e}") from None
    if getattr(args, "fast_dropout", True):  # cheaper CPU dropout masks (see dropout.py)
        from .dropout import use_fast_dropout
        fast = use_fast_dropout(model)
        if fast and fast[0].rate != fast[0].p:
            info(f"--fast_dropout: lora_dropout {fast[0].p} is drawn as {fast[0].threshold}/"
                 f"{1 << fast[0].bits} = {fast[0].rate:.4g} (--fast_dropout false: exactly)")
    if fused:  # faster adapter gradients (see fused_lora.py)
        from .fused_lora import keep_frozen_outputs, use_fused_lora
        use_fused_lora(model)
        if selective:
            keep_frozen_outputs(model)
    from .precision import fp32_activations, wants_fp32_activations
    if wants_fp32_activations(model, args, device):  # bf16 matmuls, fp32 activations
        fp32_activations(model)
    trainable, total = _count(model), _count(model, trainable_only=False)
    info(f"LoRA r={args.lora_rank} alpha={args.lora_alpha} on {target}: {trainable:,} trainable "
         f"of {total:,} parameters ({100 * trainable / total:.3f}%)")
    return model


def _count(model, trainable_only: bool = True) -> int:
    # ZeRO-3 loads partitioned: a parameter's full size is then ds_numel, numel() is 0.
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()
               if p.requires_grad or not trainable_only)


def check_target_modules(model, targets) -> None:
    """A UsageError naming every --target_modules entry that matches no module of `model`
    (peft's rule for a list: a module's full name, or its ending after a dot), with the names
    there are. Run on the meta-device model (memory.meta_model), it reports a typo before any
    weights are loaded; peft itself would only after."""
    if isinstance(targets, str) or is_all_linear(targets):
        return  # a single string is a regex to peft: left to peft
    names = [n for n, _ in model.named_modules() if n]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        import torch
        linear = sorted({n.split(".")[-1] for n, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear)})
        from .errors import UsageError
        raise UsageError(f"--target_modules {' '.join(missing)}: no such module in this model. "
                         f"Its linear layers: {', '.join(linear)}; or all-linear.")


def check_target_modules_before_loading(model_dir: str, targets,
                                        trust_remote_code: bool = False) -> None:
    """check_target_modules on the meta-device build of model_dir's config.json, for sft to
    call before loading the weights (a minute for a 7B model). Remote-code models (their
    module names may differ from transformers' class) and architectures transformers cannot
    build from the config alone are left to peft's own check."""
    if trust_remote_code or isinstance(targets, str) or is_all_linear(targets):
        return
    from .errors import UsageError
    from .memory import meta_model, read_config
    try:
        _, model = meta_model(*read_config(model_dir))
    except UsageError:
        return
    check_target_modules(model, targets)
