"""What a command's own process imports: a start reads each imported library, from disk when
the cache is cold (#42)."""
from __future__ import annotations

import sys

# Set by the `swiftlite` command for its own process (cli.main): a Python caller of the API
# may use these libraries after a run, so only the command's process leaves them out.
command_process = False

# Optimizers that do not use bitsandbytes ("": the Trainer's default); any other keeps it.
PLAIN_OPTIMIZERS = ("", "adamw_torch", "adamw_torch_fused", "sgd", "adagrad", "adafactor",
                    "rmsprop")


def leave_out_unused(args) -> None:
    """Libraries a run does not use are imported anyway by those it does, whenever installed:
    peft imports bitsandbytes, which imports torch's inductor, the Trainer (through
    accelerate) imports DeepSpeed, and transformers' models import SciPy for the matching in
    object-detection losses; each a fraction of a second of every start and tens of MB
    (docs/performance.md). bitsandbytes is left out of a run with neither a
    4/8-bit base (--quant_bits) nor one of its optimizers (adamw_bnb_8bit, paged_*, lion_*,
    ...), DeepSpeed out of a run without --deepspeed, SciPy out of every run (no causal LM's
    training uses it). The libraries then take each as not installed: importlib finds no
    module set to None in sys.modules."""
    if not command_process:
        return
    optim = str((getattr(args, "training_args", None) or {}).get("optim") or "")
    unused = ["scipy"]
    if getattr(args, "quant_bits", None) is None and optim in PLAIN_OPTIMIZERS:
        unused.append("bitsandbytes")
    if not getattr(args, "deepspeed", None):
        unused.append("deepspeed")
    for name in unused:
        sys.modules.setdefault(name, None)  # unless imported already
