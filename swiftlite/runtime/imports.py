"""What a command's own process imports: a start reads each imported library, from disk when
the cache is cold (#42)."""
from __future__ import annotations

import sys

# Set by the `swiftlite` command for its own process (cli.main): a Python caller of the API
# may import bitsandbytes after a run, so only the command's process leaves it out.
command_process = False

# Optimizers that do not use bitsandbytes ("": the Trainer's default); any other keeps it.
PLAIN_OPTIMIZERS = ("", "adamw_torch", "adamw_torch_fused", "sgd", "adagrad", "adafactor",
                    "rmsprop")


def skip_bitsandbytes(args) -> None:
    """peft imports bitsandbytes whenever it is installed, and bitsandbytes imports torch's
    inductor: about a second of every start (docs/performance.md), for a run with neither a
    4/8-bit base (--quant_bits) nor one of bitsandbytes' optimizers (adamw_bnb_8bit, paged_*,
    lion_*, ...). peft then takes it as not installed: importlib finds no module set to None
    in sys.modules."""
    optim = str((getattr(args, "training_args", None) or {}).get("optim") or "")
    uses_it = getattr(args, "quant_bits", None) is not None or optim not in PLAIN_OPTIMIZERS
    if command_process and not uses_it and "bitsandbytes" not in sys.modules:
        sys.modules["bitsandbytes"] = None
