"""--precompute_ref_log_probs: the reference log-probs of every pair, computed once before
training and kept beside the encoded pairs in the cache, so that a second run on the same pairs
and reference reuses them and each step runs the policy alone.

The cache key covers what the numbers depend on: the encoded pairs (their cache entry), the
model's weights files, the adapter that is the reference (or none), the dtype and the autocast
it is computed under, and a PiSSA/OLoRA init (the reference is then the starting model with
its adapters on)."""
from __future__ import annotations

import hashlib
import json
import os

from swiftlite.log import info
from swiftlite.runtime.atomic import replacing


def _weights_fingerprint(folder: str) -> list:
    """Names, sizes and modification times of a folder's weight files (cheap, and changed by
    any rewrite of them)."""
    out = []
    for name in sorted(os.listdir(folder)):
        if name.endswith((".safetensors", ".bin", ".json")):
            st = os.stat(os.path.join(folder, name))
            out.append([name, st.st_size, int(st.st_mtime)])
    return out


def _trainer_autocast(model, args, dtype: str, hw):
    """The dtype the Trainer will autocast to (None: none), so that the reference is computed
    as the policy's first step will be: full fine-tuning keeps fp32 master weights and
    computes in 16 bits by autocast (runtime/hardware.py: weights_dtype). Under DeepSpeed
    accelerate autocasts nothing (DeepSpeed's own 16-bit mode casts the model)."""
    import torch

    from swiftlite.runtime.hardware import amp_flags
    from swiftlite.training.deepspeed import resolve
    if resolve(args, hw) is not None:
        return None
    weights = next(p.dtype for p in model.parameters() if p.is_floating_point())
    flags = amp_flags(dtype, hw, str(weights).removeprefix("torch."))
    return torch.bfloat16 if flags["bf16"] else torch.float16 if flags["fp16"] else None


def _key(report, args, adapter: str | None, autocast) -> str | None:
    if not report.cache_path:
        return None  # data not cached (--load_from_cache_file false): nothing to key on
    from swiftlite.models import resolve_model
    model_dir, _ = resolve_model(args.model)
    h = hashlib.sha256(json.dumps([
        report.cache_path, _weights_fingerprint(model_dir),
        _weights_fingerprint(adapter) if adapter else None, args.torch_dtype,
        args.quant_bits, args.attn_impl, str(autocast)]
        + ([args.init_lora_weights] * args.mutated_init)
    ).encode())
    return h.hexdigest()[:20]


def with_reference_logps(model, dataset, report, collator, args, hw, adapter: str | None,
                         dtype: str):
    """`dataset` with ref_chosen_logps / ref_rejected_logps columns; `dtype`: the run's compute
    dtype."""
    import torch

    from swiftlite.training.preference.trainer import precompute_reference
    amp = _trainer_autocast(model, args, dtype, hw)
    key = _key(report, args, adapter, amp)
    path = os.path.join(report.cache_path, f"ref_logps-{key}.pt") if key else None
    if path and os.path.exists(path):
        chosen, rejected = torch.load(path, weights_only=True)
        info(f"reference log-probs loaded from {path}")
    else:
        device = "cuda" if hw.device == "cuda" else hw.device
        model.to(device)
        # the model as it starts (with a PiSSA/OLoRA init, adapters on: off is a residual)
        as_is = adapter is not None or args.train_type == "full" or args.mutated_init
        what = (f"the adapters of {adapter}" if adapter else "the model as it starts") if as_is \
            else "the model without its adapters"
        how = f", {str(amp).removeprefix('torch.')} by autocast as in training" if amp else ""
        info(f"computing the reference log-probs of {len(dataset)} pairs once ({what}{how}) ...")
        chosen, rejected = precompute_reference(model, dataset, collator,
                                                args.per_device_eval_batch_size, device,
                                                use_adapters=as_is, autocast=amp)
        if path:
            with replacing(path, "wb") as f:
                torch.save((chosen, rejected), f)
            info(f"reference log-probs cached in {path}")
    return dataset.add_column("ref_chosen_logps", chosen).add_column("ref_rejected_logps",
                                                                     rejected)
