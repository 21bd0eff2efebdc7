"""Process-group facts read from the launcher's environment (torchrun / deepspeed)."""
import os
import sys
from contextlib import contextmanager


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


# Set by a run for itself: a process group of one for DeepSpeed, accelerate's DeepSpeed
# switch, DeepSpeed's accelerator on a CPU (deepspeed.py), the TensorBoard folder (trainer.py).
RUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
           "ACCELERATE_USE_DEEPSPEED", "DS_ACCELERATOR", "TENSORBOARD_LOGGING_DIR")


@contextmanager
def run_scope():
    """Undo at the end of a run what it set up for itself in this process: the environment
    variables above, accelerate's shared state, a process group it started, and the library
    warnings it hid. Without this, a plain run after a DeepSpeed one in the same Python process
    (the Python API) silently ran under DeepSpeed. What existed before the run (a launcher's
    process group, the caller's own accelerate state) is left as it was."""
    import warnings
    from .log import hide_library_noise
    before = {k: os.environ.get(k) for k in RUN_ENV}
    # Looked up, not imported: a bad data row should fail before torch is even loaded.
    had_state, had_group = _accelerate_state() is not None, _process_group() is not None
    try:
        with warnings.catch_warnings():  # the caller's warning filters come back afterwards
            hide_library_noise()
            yield
    finally:
        if not had_group and before["WORLD_SIZE"] is None and _process_group() is not None:
            _destroy_process_group()  # the group of one that deepspeed.py started
        state = _accelerate_state()
        if not had_state and state is not None:  # accelerate's own reset, as its tests do
            state.AcceleratorState._reset_state(reset_partial_state=True)
            state.GradientState._reset_state()
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _accelerate_state():
    """accelerate's state module if it holds a state (None when not even imported)."""
    state = sys.modules.get("accelerate.state")
    return state if state is not None and state.PartialState._shared_state else None


def _process_group():
    """torch.distributed if a default process group exists (None when not even imported)."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def _destroy_process_group() -> None:
    # DeepSpeed keeps its own references to the groups (its world-group clone among them); its
    # destroy releases them too, so a later DeepSpeed run in this process builds fresh ones.
    ds_comm = sys.modules.get("deepspeed.comm.comm")
    if ds_comm is not None and ds_comm.is_initialized():
        ds_comm.destroy_process_group()
    else:
        import torch.distributed as dist
        dist.destroy_process_group()
