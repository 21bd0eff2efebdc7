"""Speed-ups of a training step, one file and one flag each (all on by default where they
apply; docs/performance.md has what each buys):

  packed_attention         --padding_free: SDPA per packed sample, not one block mask
  keep_attention           --keep_attention: attention's output kept for the recompute (CPU)
  selective_checkpointing  --selective_checkpointing: keep frozen matmul outputs
  fast_dropout             --fast_dropout: LoRA dropout drawn as the positions it drops (CPU)
  fused_lora               --fused_lora: each LoRA layer as one autograd function (CPU)
  fp32_activations         --fp32_activations: bf16 frozen matmuls, fp32 activations (CPU)
                           --bf16_lora_matmuls: the fused adapters' matmuls in bf16 too
  chunked_loss             --chunked_loss: LM head only at trained positions (the Trainer's)
  onednn_fp32              --onednn_fp32: fp32 matmuls by oneDNN where faster than BLAS (CPU)
  batch_threads            --batch_threads: a batch's samples in threads (sft, CPU; the
                           Trainer's step, decided when the trainer is built)

`plan` decides which apply to this model, arguments and device; `apply` installs them on the
model that will train (after LoRA wrapping); `checkpoint_kwargs` is what gradient
checkpointing is enabled with. Adding a speed-up: a file here with its flag in
TrainArguments, a line in Plan and in apply, and a test of equal per-step loss on and off.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from swiftlite.log import info, warn
from swiftlite.runtime.hardware import cpu_flags


@dataclass(frozen=True)
class Plan:
    packed_attention: bool
    selective_checkpointing: bool
    fast_dropout: bool
    fused_lora: bool
    fp32_activations: bool
    bf16_lora_matmuls: bool = False
    reentrant_checkpointing: bool = False
    keep_attention: bool = False
    onednn_fp32: bool = False
    keep_budget: Optional[int] = None  # bytes of frozen outputs a forward keeps; None: all


# DeepSpeed's fix (#8148) for ZeRO-3 under non-reentrant checkpointing: before it, frozen
# weights were back in their partitions (empty) when a layer was recomputed, and torch's
# check of the recomputed tensors failed ("saved vs recomputed" CheckpointError).
ZERO3_NON_REENTRANT_SINCE = "0.19.3"


def plan(model, args, device: str) -> Plan:
    """Which speed-ups apply. `device`: where the model will train (it may sit on the CPU now)."""
    first = next(model.parameters())
    lora = args.train_type == "lora"
    reentrant = args.gradient_checkpointing and _zero3_needs_reentrant(hasattr(first, "ds_id"))
    # Fused LoRA layers on CPUs only (GPUs keep peft's layers under autocast), and not on
    # ZeRO-3's partitioned weights, which DeepSpeed gathers through the modules' hooks.
    fused = lora and args.fused_lora and device == "cpu" and not hasattr(first, "ds_id")
    variants = [flag for flag in ("use_dora", "lora_bias") if getattr(args, flag, False)]
    if fused and variants:
        info(f"--fused_lora steps aside for --{' and --'.join(variants)} (its function has no "
             "DoRA magnitude and no bias on lora_B): peft's LoRA layers")
        fused = False
    selective = bool(args.gradient_checkpointing and args.selective_checkpointing)
    if selective and reentrant:
        warn("--selective_checkpointing needs non-reentrant checkpointing, which this "
             "DeepSpeed cannot run under ZeRO-3: plain gradient checkpointing.")
        selective = False
    if selective and not lora:
        warn("--selective_checkpointing keeps the outputs of frozen matmuls, and full "
             "fine-tuning trains every weight: nothing to keep, so plain gradient checkpointing.")
        selective = False
    from swiftlite.training.speedups.fp32_activations import wants_fp32_activations
    fp32_act = wants_fp32_activations(model, args, device)
    if getattr(model, "is_quantized", False):
        # bitsandbytes' layers are not nn.Linear: nothing to fuse, no plain matmul output to
        # keep or cast. Padding-free attention, chunked loss and fast dropout still apply.
        aside = [n for n, on in (("fused_lora", fused), ("selective_checkpointing", selective),
                                 ("fp32_activations", fp32_act)) if on]
        if aside:
            info(f"--quant_bits: {', '.join(aside)} {'stands' if len(aside) == 1 else 'stand'} "
                 "aside (it works on plain linear layers); padding_free, chunked_loss and "
                 "fast_dropout stay on")
        fused = selective = fp32_act = False
    budget = None
    # Not with an fp32 base: its weights take twice the memory already, and kept outputs on top
    # broke the memory goal on an AVX2-only CPU (docs/performance.md)
    if (args.selective_checkpointing is None and fused and args.gradient_checkpointing
            and base_is_16_bit(model)):
        selective, budget = True, keep_budget(model)
    bf16_lora = fused and fp32_act and args.bf16_lora_matmuls
    if bf16_lora and "amx_bf16" in cpu_flags():
        # Measured on AVX-512-BF16 only: on AMX its 12-step loss drifted 4.5x further from an
        # all-fp32 run than fp32 adapter products on the same bf16 base (docs/performance.md)
        info("--bf16_lora_matmuls steps aside on this AMX CPU (its bf16 adapter products "
             "drift from fp32 ones here): fp32 adapter matmuls over the bf16 base")
        bf16_lora = False
    # --attn_impl given: the user's attention implementation, as it is
    packed = args.padding_free and not args.attn_impl
    return Plan(
        packed_attention=packed,
        selective_checkpointing=selective, keep_budget=budget,
        fast_dropout=lora and args.fast_dropout,
        fused_lora=fused, fp32_activations=fp32_act,
        bf16_lora_matmuls=bf16_lora,
        reentrant_checkpointing=reentrant,
        # in packed attention's CPU path, and only a recompute can use what it keeps
        keep_attention=(packed and args.keep_attention and args.gradient_checkpointing
                        and device == "cpu"),
        onednn_fp32=args.onednn_fp32 and device == "cpu" and str(first.dtype) == "torch.float32")


def base_is_16_bit(model) -> bool:
    """Whether the frozen base is stored in bf16 or fp16 (its first parameter's dtype: a causal
    LM's input embeddings): the defaults that keep more per step are for such a base only
    (docs/performance.md)."""
    return next(model.parameters()).element_size() == 2


def keep_budget(model) -> int:
    """Bytes of frozen matmul outputs one forward keeps when --selective_checkpointing is not
    given (fused LoRA layers over a 16-bit base): half the frozen weights' memory, so the run
    stays lean (docs/performance.md has what it costs and buys), and at most a tenth of the
    memory available now."""
    import psutil
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return min(weights // 2, psutil.virtual_memory().available // 10)


def _zero3_needs_reentrant(zero3: bool) -> bool:
    """Reentrant checkpointing for ZeRO-3 under a DeepSpeed older than its fix (said once)."""
    if not zero3:
        return False
    import deepspeed
    from packaging.version import Version
    if Version(deepspeed.__version__) >= Version(ZERO3_NON_REENTRANT_SINCE):
        return False
    info(f"DeepSpeed {deepspeed.__version__} fails ZeRO-3 with non-reentrant gradient "
         f"checkpointing (fixed in {ZERO3_NON_REENTRANT_SINCE}): using reentrant checkpointing. "
         f"pip install 'deepspeed>={ZERO3_NON_REENTRANT_SINCE}' for the non-reentrant kind.")
    return True


def checkpoint_kwargs(p: Plan) -> dict:
    """Gradient checkpointing's kwargs. Selective: fused LoRA layers keep their frozen outputs
    themselves (fused_lora.keep_frozen_outputs); otherwise torch's policy-based version.
    Reentrant only where ZeRO-3 needs it (peft makes the inputs require grad for it)."""
    if p.reentrant_checkpointing:
        return {"use_reentrant": True}
    from swiftlite.training.speedups.selective_checkpointing import checkpoint_kwargs as kw
    return kw(p.selective_checkpointing and not p.fused_lora)


def apply(model, p: Plan) -> list[str]:
    """Install the planned speed-ups on `model` (the peft model for LoRA); returns their names."""
    done = []
    if p.packed_attention:
        from swiftlite.training.speedups.packed_attention import use_packed_attention
        if use_packed_attention(model):
            done.append("packed_attention")
            if p.keep_attention:
                from swiftlite.training.speedups.keep_attention import keep_attention
                if keep_attention(model):
                    done.append("keep_attention")
    if p.fast_dropout:
        from swiftlite.training.speedups.fast_dropout import use_fast_dropout
        if use_fast_dropout(model):
            done.append("fast_dropout")
    if p.fused_lora:
        from swiftlite.training.speedups.fused_lora import keep_frozen_outputs, use_fused_lora
        if use_fused_lora(model, p.bf16_lora_matmuls):
            done.append("fused_lora")
            if p.bf16_lora_matmuls:
                done.append("bf16_lora_matmuls")
        if p.selective_checkpointing:
            keeping = keep_frozen_outputs(model, p.keep_budget)
            if keeping and p.keep_budget is not None:
                info(f"selective checkpointing: frozen matmul outputs kept in the layers that "
                     f"fit in {p.keep_budget / 2**20:,.0f} MB a forward, the rest recomputed "
                     "(--selective_checkpointing true: every layer, false: none)")
    if p.selective_checkpointing:
        done.append("selective_checkpointing")
    if p.onednn_fp32:
        from swiftlite.training.speedups import onednn_fp32
        if onednn_fp32.use_onednn_fp32(model):
            done.append("onednn_fp32")
        info(onednn_fp32.describe())
    if p.fp32_activations:
        from swiftlite.training.speedups.fp32_activations import fp32_activations
        if fp32_activations(model):
            done.append("fp32_activations")
    return done
