"""Process-group facts read from the launcher's environment (torchrun / deepspeed)."""
import os
import sys
from contextlib import contextmanager


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def barrier() -> None:
    """Wait for every rank, if there is more than one process."""
    dist = process_group()
    if dist is not None and dist.get_world_size() > 1:
        dist.barrier()


def all_ranks_min(tensor):
    """The element-wise minimum of `tensor` over every rank (itself in a single process)."""
    dist = process_group()
    if dist is None or dist.get_world_size() == 1:
        return tensor
    out = tensor.clone()
    dist.all_reduce(out, op=dist.ReduceOp.MIN)
    return out


def from_main(value):
    """The main process's `value` on every rank (a picklable object; waits for every rank)."""
    dist = process_group()
    if dist is None or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# Set by a run for itself: a process group of one for DeepSpeed, accelerate's DeepSpeed
# switch, DeepSpeed's accelerator on a CPU (deepspeed.py), the TensorBoard folder (trainer.py).
RUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
           "ACCELERATE_USE_DEEPSPEED", "DS_ACCELERATOR", "TENSORBOARD_LOGGING_DIR")


@contextmanager
def run_scope():
    """Undo at the end of a run what it set up for itself in this process: the environment
    variables above, accelerate's shared state, a process group it started, and the library
    warnings it hid. Without this, a plain run after a DeepSpeed one in the same Python process
    (the Python API) silently ran under DeepSpeed. What existed before the run (the caller's own
    process group, its own accelerate state) is left as it was."""
    import warnings
    from swiftlite.log import hide_library_noise
    before = {k: os.environ.get(k) for k in RUN_ENV}
    # Looked up, not imported: a bad data row should fail before torch is even loaded.
    had_states, had_group = _accelerate_states(), process_group() is not None
    try:
        with warnings.catch_warnings():  # the caller's warning filters come back afterwards
            hide_library_noise()
            yield
    finally:
        if not had_group and process_group() is not None:
            if before["WORLD_SIZE"] is None:
                end_process_group()  # the group of one that deepspeed.py started
            else:
                # The launcher's ranks' group, which the run started: it stays for later runs
                # in this process, and is ended at exit, before the interpreter's teardown,
                # where a live gloo group can abort a finished rank ("terminate called without
                # an active exception": a Python-API run under torchrun in CI once).
                import atexit
                atexit.unregister(_end_at_exit)
                atexit.register(_end_at_exit)
        # Each of accelerate's three shared states that the run created is cleared, as
        # accelerate's own _reset_state does between its tests; one the caller had (e.g. a
        # PartialState from its own TrainingArguments) stays.
        state = sys.modules.get("accelerate.state")
        for name in _accelerate_states() - had_states:
            getattr(state, name)._shared_state.clear()
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _end_at_exit() -> None:
    if process_group() is not None:
        end_process_group()


def _accelerate_states() -> set[str]:
    """Which of accelerate's shared states exist (none when accelerate is not imported)."""
    state = sys.modules.get("accelerate.state")
    if state is None:
        return set()
    return {name for name in ("PartialState", "AcceleratorState", "GradientState")
            if getattr(state, name)._shared_state}


def process_group():
    """torch.distributed if a default process group exists (None when not even imported)."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def end_process_group() -> None:
    # DeepSpeed keeps its own references to the groups (its world-group clone among them); its
    # destroy releases them too, so a later DeepSpeed run in this process builds fresh ones.
    ds_comm = sys.modules.get("deepspeed.comm.comm")
    if ds_comm is not None and ds_comm.is_initialized():
        ds_comm.destroy_process_group()
    else:
        import torch.distributed as dist
        dist.destroy_process_group()
