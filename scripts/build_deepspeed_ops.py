"""Build DeepSpeed's CPU op ahead of its first use (scripts/test.sh runs it).

DeepSpeed compiles CPU Adam (ZeRO offload, `offload_optimizer: cpu`) just in time with ninja
and g++ and caches it under ~/.cache/torch_extensions; a run that needs it builds it before
its model loads otherwise. Run with the venv's bin first on PATH: the cache is keyed by
ninja's hash of the command, which differs between ninja versions. (swiftlite never loads the
other op DeepSpeed builds on a CPU, its shared-memory all-reduce.)

  python scripts/build_deepspeed_ops.py [BuilderName]
"""
import sys
import time

OPS = ("CPUAdamBuilder",)


def build(name: str) -> None:
    from deepspeed.accelerator import get_accelerator
    start = time.time()
    get_accelerator().create_op_builder(name).load(verbose=False)
    print(f"DeepSpeed {name}: ready in {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    from swiftlite.runtime.build_locks import clear_stale
    clear_stale()  # a lock left by a killed build (an interrupted setup) would hang it
    for name in sys.argv[1:] or OPS:
        build(name)
