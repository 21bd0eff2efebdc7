"""Process-group facts read from the launcher's environment (torchrun / deepspeed)."""
import os


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))
