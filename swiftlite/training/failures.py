"""What a training run that fails says and leaves behind: a disk that fills is named with the
last complete checkpoint, which is intact (the one being written was never marked complete);
a start that fails before its first step (a checkpoint that cannot be loaded) removes the run
folder it made, so failed resumes leave no orphan args.json."""
from __future__ import annotations

import errno
import os
import re
import shutil

from swiftlite.errors import RunError, SwiftliteError, UsageError
from swiftlite.runtime.output import checkpoints, is_complete, last_checkpoint

# errno -> what it means for the run's folder
DISK_ERRORS = {
    errno.ENOSPC: "the disk holding it is full",
    errno.EDQUOT: "the disk quota of this user is used up",
    errno.EFBIG: "a file would grow past this process's file size limit (ulimit -f)",
}
# The same errors as the writers say them in words (safetensors' Rust writer, torch.save's
# PytorchStreamWriter) rather than as an OSError.
_OS_ERROR = re.compile(r"os error (\d+)|\[Errno (\d+)\]")
_WORDS = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
          "File too large": errno.EFBIG}


def disk_errno(exc: BaseException, folder: str) -> int | None:
    """The errno of a write into `folder` that failed for want of space, found in `exc` or its
    causes (torch's writer names no errno: a disk with under 64 MiB free is taken as full)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in DISK_ERRORS:
            return exc.errno
        text = str(exc)
        for m in _OS_ERROR.finditer(text):
            code = int(m.group(1) or m.group(2))
            if code in DISK_ERRORS:
                return code
        for words, code in _WORDS.items():
            if words in text:
                return code
        if "PytorchStreamWriter failed writing" in text and _free(folder) < 2**26:
            return errno.ENOSPC
        exc = exc.__cause__ or exc.__context__
    return None


def _free(folder: str) -> float:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return float("inf")


def explain(exc: BaseException, args, run_dir: str, started: bool) -> SwiftliteError | None:
    """The error to end the run with instead of `exc` (None: let it through), after cleaning up
    what the failed run left: the incomplete checkpoint of a full disk, or the whole run folder
    of a start that never trained a step."""
    if isinstance(exc, SwiftliteError) or not isinstance(exc, Exception):
        if not started:
            discard_run_dir(run_dir)
        return None
    code = disk_errno(exc, run_dir)
    if code is not None:
        return RunError(_disk_full(code, run_dir, args))
    if not started:
        discard_run_dir(run_dir)
        if args.resume_from_checkpoint:
            first = " ".join(str(exc).split())[:300]
            return UsageError(
                f"--resume_from_checkpoint {args.resume_from_checkpoint} could not be loaded "
                f"({type(exc).__name__}: {first}). It is damaged, or was written by a run with "
                "other settings (--model, --train_type, --lora_rank, --target_modules, "
                "--deepspeed) than these. Nothing was trained; the run folder was removed.")
    return None


def _disk_full(code: int, run_dir: str, args) -> str:
    from swiftlite.log import is_main_process
    removed = []
    last = last_checkpoint(run_dir)
    if is_main_process():
        for step, path in checkpoints(run_dir):  # being written when the disk filled
            if not is_complete(path) and (last is None or path > last):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(os.path.basename(path))
    what = (f"writing to {run_dir} failed: {DISK_ERRORS[code]} ({errno.errorcode[code]}; "
            f"{_free(run_dir) / 1e9:.2f} GB free now)")
    if removed:
        what += f"; the incomplete {', '.join(removed)} was removed"
    resume = args.resume_from_checkpoint
    if last:
        return (f"{what}. The last complete checkpoint, {last}, is intact: make room, then go "
                f"on with --resume_from_checkpoint {last}.")
    if resume:
        return (f"{what}. This run saved no complete checkpoint; the one it resumed from, "
                f"{resume}, is untouched: make room, then resume from it again.")
    return f"{what}. This run saved no complete checkpoint: make room, then start it again."


def discard_run_dir(run_dir: str) -> None:
    """Remove the folder of a run that never trained a step (args.json, an empty log): made
    by this run (claimed atomically), so nothing in it is anyone else's."""
    from swiftlite.log import is_main_process
    from swiftlite.runtime.output import remove_if_empty
    if is_main_process() and os.path.isdir(run_dir) and not checkpoints(run_dir):
        for name in os.listdir(run_dir):
            path = os.path.join(run_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
        remove_if_empty(run_dir)  # and the output_dir, if this start made it
