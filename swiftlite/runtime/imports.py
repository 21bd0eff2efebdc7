"""What a command's process imports at start: the cold start every user meets first reads each
imported library from disk."""
from __future__ import annotations

import sys


def skip_bitsandbytes(args) -> None:
    """peft imports bitsandbytes whenever it is installed (and bitsandbytes imports torch's
    inductor): seconds of a cold start that a run without --quant_bits never uses. For the
    CLI's own process only (a Python API caller may use bitsandbytes afterwards): peft then sees
    it as not installed, as importlib.util.find_spec does for a module set to None."""
    optim = str((getattr(args, "training_args", None) or {}).get("optim", ""))
    uses_it = getattr(args, "quant_bits", None) is not None or "bnb" in optim or "8bit" in optim \
        or "paged" in optim  # bitsandbytes' optimizers (--optim adamw_bnb_8bit, paged_adamw_32bit)
    if not uses_it and "bitsandbytes" not in sys.modules:
        sys.modules["bitsandbytes"] = None
