"""Build DeepSpeed's CPU ops ahead of their first use (scripts/test.sh runs it).

DeepSpeed compiles them just in time with ninja and g++ and caches them under
~/.cache/torch_extensions: CPU Adam (ZeRO offload, `offload_optimizer: cpu`) and the
shared-memory all-reduce of its CPU accelerator. A run that needs one builds it at its first
step otherwise. Run with the venv's bin first on PATH: the cache is keyed by ninja's hash of
the command, which differs between ninja versions. The two build at once, one process each
(each is one compiler process, and a host has at least two cores).

  python scripts/build_deepspeed_ops.py [BuilderName]
"""
import subprocess
import sys
import time

OPS = ("CPUAdamBuilder", "ShareMemCommBuilder")


def build(name: str) -> None:
    from deepspeed.accelerator import get_accelerator
    start = time.time()
    get_accelerator().create_op_builder(name).load(verbose=False)
    print(f"DeepSpeed {name}: ready in {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        build(sys.argv[1])
    else:
        from swiftlite.runtime.build_locks import clear_stale
        clear_stale()  # a lock left by a killed build (an interrupted setup) would hang both
        builds = [subprocess.Popen([sys.executable, __file__, name]) for name in OPS]
        sys.exit(max(b.wait() for b in builds))
