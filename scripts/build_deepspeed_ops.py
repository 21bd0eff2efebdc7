"""Build DeepSpeed's CPU ops ahead of their first use (scripts/test.sh runs it).

DeepSpeed compiles them just in time with ninja and g++ and caches them under
~/.cache/torch_extensions: CPU Adam (ZeRO offload, `offload_optimizer: cpu`) and the
shared-memory all-reduce of its CPU accelerator. A run that needs one builds it at its first
step otherwise. Run with the venv's bin first on PATH: the cache is keyed by ninja's hash of
the command, which differs between ninja versions.
"""
import time

from deepspeed.accelerator import get_accelerator

for name in ("CPUAdamBuilder", "ShareMemCommBuilder"):
    start = time.time()
    get_accelerator().create_op_builder(name).load(verbose=False)
    print(f"DeepSpeed {name}: ready in {time.time() - start:.0f} s", flush=True)
