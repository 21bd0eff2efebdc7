"""--resume_from_checkpoint, checked before anything is loaded: a checkpoint-<step> folder, or
a run folder (its last complete checkpoint). A checkpoint that lacks a file the Trainer needs
to continue exactly (weights, optimizer, scheduler, trainer state, RNG), or that was never
marked complete (its run stopped while saving it), or whose files differ from the sizes and
hashes recorded when it was marked (runtime.output.damaged_files), is refused by name: resuming
from it would silently restart the optimizer, the LR schedule or the data order, or die in a
traceback once the model has loaded."""
from __future__ import annotations

import json
import os
import re

from swiftlite.errors import UsageError
from swiftlite.runtime.output import (COMPLETE_MARKER, checkpoints, damaged_files, is_complete,
                                      last_checkpoint)


def required_files(train_type: str, deepspeed) -> list[tuple[str, tuple[str, ...]]]:
    """(what, any of these names) a checkpoint needs to be resumed."""
    need = [("the trainer state", ("trainer_state.json",)),
            ("the RNG state", ("rng_state.pth", "rng_state_0.pth"))]
    if train_type == "lora":
        need.append(("the adapter weights", ("adapter_model.safetensors", "adapter_model.bin")))
    elif not deepspeed:  # ZeRO keeps full weights in its own global_step folder
        need.append(("the model weights", ("model.safetensors", "model.safetensors.index.json",
                                           "pytorch_model.bin", "pytorch_model.bin.index.json")))
    if deepspeed:
        need.append(("DeepSpeed's optimizer state", ("latest",)))
    else:
        need += [("the optimizer state", ("optimizer.pt",)),
                 ("the LR scheduler state", ("scheduler.pt",))]
    return need


def resolve_resume(path: str, train_type: str = "lora", deepspeed=None) -> str:
    """The checkpoint folder to resume from; UsageError naming what is wrong."""
    ckpt = path
    if not re.fullmatch(r"checkpoint-\d+", os.path.basename(os.path.normpath(path))):
        found = checkpoints(path)
        if not found:
            raise UsageError(f"--resume_from_checkpoint {path}: neither a checkpoint-<step> "
                             "folder nor a run folder holding one.")
        ckpt = last_checkpoint(path)
        if ckpt is None:
            raise UsageError(f"--resume_from_checkpoint {path}: none of its checkpoints "
                             f"({', '.join(os.path.basename(p) for _, p in found)}) is "
                             "complete; every save was cut short. Start the run anew.")
    missing = [f"{what} ({' or '.join(names)})" for what, names in
               required_files(train_type, deepspeed)
               if not any(os.path.exists(os.path.join(ckpt, n)) for n in names)]
    instead = _instead(ckpt)
    if missing:
        raise UsageError(f"--resume_from_checkpoint {ckpt}: missing {'; '.join(missing)}, "
                         "so training cannot continue where it stopped." + instead)
    if not is_complete(ckpt):
        raise UsageError(
            f"--resume_from_checkpoint {ckpt} is incomplete: it has no {COMPLETE_MARKER}, so "
            "it was still being written when its run stopped." + instead + " (A checkpoint "
            "written before swiftlite marked complete ones has no marker either: if you know "
            f"it is whole, create an empty {COMPLETE_MARKER} in it.)")
    if deepspeed:
        _warn_if_foreign(ckpt)
    damaged = damaged_files(ckpt)
    if damaged:
        raise UsageError(f"--resume_from_checkpoint {ckpt} is damaged: {'; '.join(damaged)} (a "
                         "disk error, a full disk or an incomplete copy). Nothing was loaded."
                         + (instead or " It is the run's only complete checkpoint: copy it "
                            "again from where it was made, or start the run anew."))
    return ckpt


def _instead(ckpt: str) -> str:
    """Where to resume instead: the last complete, undamaged checkpoint before `ckpt`."""
    run_dir = os.path.dirname(os.path.normpath(ckpt))
    for _, p in reversed(checkpoints(run_dir)):
        if p != ckpt and _step(p) < _step(ckpt) and is_complete(p) and not damaged_files(p):
            return f" Resume from {p}, the last complete checkpoint before it."
    return ""


def _step(ckpt: str) -> int:
    return int(os.path.basename(os.path.normpath(ckpt)).rsplit("-", 1)[1])


def _warn_if_foreign(ckpt: str) -> None:
    """DeepSpeed's resume reads its own files with torch.load(weights_only=False) (DeepSpeed
    0.19.8): unpickling, which runs whatever code a crafted file holds. One line when the
    checkpoint does not look like the user's own: no args.json of swiftlite's in its run
    folder, or files that belong to another user."""
    from swiftlite.log import warn
    why = []
    try:
        with open(os.path.join(os.path.dirname(os.path.normpath(ckpt)), "args.json")) as f:
            if "command" not in json.load(f):
                raise ValueError
    except (OSError, ValueError, TypeError):
        why.append("its run folder has no args.json written by swiftlite")
    owners = {os.stat(os.path.join(base, n)).st_uid for base, _, names in os.walk(ckpt)
              for n in names} - {os.getuid()}
    if owners:
        why.append(f"its files belong to uid {', '.join(map(str, sorted(owners)))}, not you "
                   f"(uid {os.getuid()})")
    if why:
        warn(f"--resume_from_checkpoint {ckpt} with --deepspeed: DeepSpeed loads its optimizer "
             "and model states with pickle (torch.load weights_only=False), which runs any code "
             f"a crafted file holds, and this checkpoint may not be yours: {'; '.join(why)}. "
             "Resume only from a DeepSpeed checkpoint you trust.")
