"""Worker for tests/test_deepspeed.py: swiftlite's ZeRO-3 model loading as on a GPU/NPU host,
run under `torchrun --nproc_per_node 2` on this CPU.

What it simulates: `hardware.Hardware("cuda", ...)`, so swiftlite skips its CPU-only
DeepSpeed enablement (the accelerate state it creates on a CPU host, which starts the process
group early) and goes down the path a GPU host takes. DeepSpeed itself runs on its CPU
accelerator with gloo. Each rank writes what it holds after loading tiny-qwen2.

    torchrun --nproc_per_node 2 tests/helpers/zero3_init_gpu_branch.py OUT_DIR
"""
import json
import os
import sys

from swiftlite.config.arguments import SftArguments
from swiftlite.models import resolve_model
from swiftlite.models.loader import load_model
from swiftlite.runtime.hardware import Hardware
from swiftlite.training.deepspeed import zero3_init

out_dir = sys.argv[1]
gpu = Hardware("cuda", "simulated GPU", capability=(8, 0), count=2, memory_bytes=24 << 30)
args = SftArguments(model="tiny-qwen2", dataset=["self-cognition#4"], deepspeed="zero3")
keep = zero3_init(args, gpu, "float32")  # kept alive while the model loads
model_dir, _ = resolve_model("tiny-qwen2")
model = load_model(model_dir, "float32")
params = list(model.parameters())
held = {"rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]),
        "partitioned": all(hasattr(p, "ds_id") for p in params),
        "local_numel": sum(p.ds_tensor.numel() for p in params),
        "full_numel": sum(p.ds_numel for p in params)}
with open(os.path.join(out_dir, f"rank{held['rank']}.json"), "w") as f:
    json.dump(held, f)
# End the process group before the interpreter's teardown: left to it, gloo's threads can
# abort a finished rank ("terminate called without an active exception"), as cli.py notes.
import torch.distributed as dist  # noqa: E402
if dist.is_initialized():
    dist.barrier()
    dist.destroy_process_group()
