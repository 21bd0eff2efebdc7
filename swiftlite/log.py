"""Progress messages for people: to stderr, prefixed, only from the main process."""
import os
import sys
from contextlib import contextmanager


def is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


_HIDDEN: set[str] = set()  # secret values (config.secrets) never printed


def hide(values) -> None:
    """Mask these strings in every later message."""
    _HIDDEN.update(v for v in values if v)


def _masked(msg: str) -> str:
    for v in _HIDDEN:
        msg = msg.replace(v, "<redacted>")
    return msg


def _prefix() -> str | None:
    """None where this process keeps quiet: every rank but the main one, unless
    SWIFTLITE_LOG_ALL_RANKS=1 (to see what each rank does), which names the rank."""
    if os.environ.get("SWIFTLITE_LOG_ALL_RANKS") == "1" and "RANK" in os.environ:
        return f"[swiftlite rank {os.environ['RANK']}]"
    return "[swiftlite]" if is_main_process() else None


def info(msg: str) -> None:
    if (prefix := _prefix()) is not None:
        print(f"{prefix} {_masked(msg)}", file=sys.stderr, flush=True)


def warn(msg: str) -> None:
    if (prefix := _prefix()) is not None:
        print(f"{prefix} WARNING: {_masked(msg)}", file=sys.stderr, flush=True)


def hide_library_noise() -> None:
    """Hide library warnings that users cannot act on (for the whole process: the CLI; for
    one run: the Python API's sft, inside warnings.catch_warnings)."""
    import warnings
    # transformers 5 renamed gradient_checkpointing -> activation_checkpointing; peft and the
    # Trainer still call the old names on every step.
    warnings.filterwarnings("ignore", message=r".*is deprecated and will be removed in v6",
                            category=FutureWarning)
    # DeepSpeed's ZeRO-3 calls torch's renamed collectives (reduce_scatter_tensor, ...); other
    # libraries' catch_warnings blocks reset Python's once-per-line memory, so a 3-step run
    # printed 97 of these.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated",
                            category=FutureWarning)
    # bitsandbytes (imported by peft whenever it is installed, QLoRA or not) looks for an
    # optional faster CPU 4-bit kernel on the hub and says so on every start when it is absent.
    import logging
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_no_kernels_notice)


def _no_kernels_notice(record) -> bool:
    return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward")


@contextmanager
def quiet_progress_bars():
    """No transformers or datasets progress bars inside (internal work whose own bar says
    nothing to the user: a verification load, writing a cache). Each library's setting is
    restored after; a library not imported yet is left alone."""
    import sys
    switches = []
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging
        switches.append((hf_logging.is_progress_bar_enabled(), hf_logging.disable_progress_bar,
                         hf_logging.enable_progress_bar))
    if "datasets" in sys.modules:
        import datasets
        switches.append((datasets.is_progress_bar_enabled(), datasets.disable_progress_bars,
                         datasets.enable_progress_bars))
    for _, disable, _ in switches:
        disable()
    try:
        yield
    finally:
        for was_enabled, _, enable in switches:
            if was_enabled:
                enable()
