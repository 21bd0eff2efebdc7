"""A batch's samples trained in threads of their own (`--batch_threads`, SFT on a CPU).

On a CPU each operator of a training step runs on all cores (torch's intra-op threads), and
between operators Python, autograd and the operators' own bookkeeping run on one core while
the others wait: a LoRA step is thousands of small operators per decoder layer. Here a
padding-free batch is cut at its sample boundaries into parts of about equal tokens, and each
part's forward and backward runs in a thread of its own with a share of the cores: one
thread's Python runs while another's matmul does (torch releases the GIL inside operators),
and each operator needs no hand-over between cores. Gradients add into the same LoRA weights
(autograd accumulates under a lock); each part's loss is normalised by the whole batch's
trained tokens, so the step is the whole batch's, as one thread would compute it up to float
rounding.

What a forward keeps for its recompute is kept per thread (recompute.py), and LoRA dropout
draws from a generator of each part's own, seeded from torch's default generator when the
step begins, so a seeded run draws the same drops whatever order the threads run in (the
parts' gradients may add in another order: with gradient accumulation or more than two parts,
equal to float rounding, not bit for bit); a part's recompute takes its forward's drop
positions (fused_lora.py) instead of replaying a random state. So only where every LoRA layer
takes the fused path with fast or no dropout, nothing else draws from torch's default
generator (the model's own dropout, NEFTune), and one process trains (`threads` decides).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from swiftlite.training.speedups import base_is_16_bit

_local = threading.local()
_pools: dict[int, ThreadPoolExecutor] = {}


def generator() -> torch.Generator | None:
    """The dropout generator of this thread's part of a batch (None: torch's default)."""
    return getattr(_local, "generator", None)


def share() -> int:
    """How many parts of a batch train at once (1 outside a split step): each keeps that
    share of what the forward passes of a step may keep (fused_lora's budget)."""
    return getattr(_local, "share", 1)


def threads(model, args, device: str) -> int:
    """How many threads a step's parts train in (1: the batch as it is), with a reason when
    the asked-for split is not possible. Default: 2 on a CPU with 2 cores or more, over a
    16-bit base."""
    from swiftlite.runtime.distributed import world_size
    asked = args.batch_threads
    if asked == 1 or (args.per_device_train_batch_size < 2 and not args.packing):
        return 1  # one sample a batch: nothing to split
    cores = torch.get_num_threads()
    why = None
    if device != "cpu" or args.deepspeed or world_size() > 1:
        why = "it splits a CPU process's batch (no GPU, DeepSpeed or several processes)"
    elif args.train_type != "lora" or not _all_fused(model, args):
        why = ("it needs every LoRA layer on --fused_lora's path (adapters in the activations' "
               "dtype)")
    elif getattr(args, "neftune_noise_alpha", None):
        why = "--neftune_noise_alpha draws its noise from torch's default generator"
    elif getattr(getattr(model, "config", None), "output_router_logits", False):
        why = "the router's auxiliary loss is per batch, not per trained token"
    elif args.lora_dropout > 0 and not args.fast_dropout:
        why = "it draws LoRA dropout with --fast_dropout"
    elif dropout := _model_dropout(model):
        why = f"the model has dropout of its own ({dropout})"
    elif asked is None and (cores < 2 or not base_is_16_bit(model)):
        return 1  # an fp32 base's step kept both cores busy already (docs/performance.md)
    if why:
        if asked is not None:
            from swiftlite.log import warn
            warn(f"--batch_threads {asked}: one thread, because {why}.")
        return 1
    return asked or 2


def _all_fused(model, args) -> bool:
    """Whether every LoRA layer takes the fused path in training: installed, and its adapters
    in the activations' dtype (fp32 over a 16-bit base with --fp32_activations, else the
    base's), as fused_lora._plain asks; peft's path would draw dropout from this thread's
    generator where checkpointing cannot replay it."""
    from peft.tuners.lora.layer import LoraLayer
    base = next(model.parameters()).dtype  # base_is_16_bit's parameter
    act = torch.float32 if args.fp32_activations and base_is_16_bit(model) else base
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    return bool(layers) and all(
        "_peft_forward" in vars(m) and all(a.weight.dtype == act for a in m.lora_A.values())
        for m in layers)


def _model_dropout(model) -> str | None:
    config = getattr(model, "config", None)
    for name in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop",
                 "attn_pdrop", "dropout"):
        if float(getattr(config, name, 0) or 0) > 0:
            return f"{name}={getattr(config, name)}"
    for name, m in model.named_modules():
        if type(m) is torch.nn.Dropout and m.p > 0:  # a LoRA layer's too: global draws
            return f"{name}: p={m.p}"
    return None


def split(inputs: dict, n: int) -> list[dict] | None:
    """`inputs` cut into at most n parts of whole samples and about equal tokens; None when it
    holds one sample or a layout this does not know. A padding-free row (1 x tokens, position
    ids restarting at 0 for each sample) is cut at the restarts, a padded batch by rows."""
    ids = inputs.get("input_ids")
    if not torch.is_tensor(ids) or ids.dim() != 2 or any(
            not torch.is_tensor(v) or v.shape[:2] != ids.shape for v in inputs.values()):
        return None
    if ids.shape[0] > 1:
        pieces = [(i, slice(None)) for i in range(ids.shape[0])]
        sizes = [int(inputs["attention_mask"][i].sum()) if "attention_mask" in inputs
                 else ids.shape[1] for i in range(ids.shape[0])]
    elif "position_ids" in inputs:
        starts = (inputs["position_ids"][0] == 0).nonzero().flatten().tolist()
        if not starts or starts[0] != 0:
            return None
        bounds = list(zip(starts, starts[1:] + [ids.shape[1]]))
        pieces = [(0, slice(s, e)) for s, e in bounds]
        sizes = [e - s for s, e in bounds]
    else:
        return None
    n = min(n, len(pieces))
    if n < 2:
        return None
    groups, load = [[] for _ in range(n)], [0] * n
    for i in sorted(range(len(pieces)), key=lambda i: -sizes[i]):  # longest first, least loaded
        g = load.index(min(load))
        groups[g].append(i)
        load[g] += sizes[i]
    parts = []
    for g in groups:
        g.sort()  # the batch's own order within a part
        if ids.shape[0] > 1:
            parts.append({k: v[g] for k, v in inputs.items()})
        else:
            parts.append({k: torch.cat([v[:, pieces[i][1]] for i in g], dim=1)
                          for k, v in inputs.items()})
    return parts


def train_step(step, inputs: dict, n: int):
    """The summed loss of step(part) over `inputs` split into n parts (whole when it cannot be
    split or n is 1), each run as `run` does; step returns its part's detached loss,
    normalised by the whole batch's trained tokens."""
    losses = run(step, split(inputs, n) or [inputs])
    return sum(losses[1:], losses[0])


def run(step, parts: list) -> list:
    """step(part) for each part, the first in this thread and the others in threads of their
    own, each with an equal share of this process's cores and its own dropout generator;
    returns their results in order, once all are done (the first error, if any, is raised
    then). A single part runs here the same way (its own generator), so every step of a run
    draws its dropout alike."""
    cores = torch.get_num_threads()
    each = max(1, cores // len(parts))
    seeds = torch.randint(0, 2**62, (len(parts),)).tolist()

    def one(i):
        torch.set_num_threads(each)
        _local.generator = torch.Generator().manual_seed(seeds[i])
        _local.share = len(parts)
        try:
            return step(parts[i])
        finally:
            _local.generator, _local.share = None, 1

    futures = []
    if len(parts) > 1:
        pool = _pools.get(len(parts) - 1)
        if pool is None:
            pool = _pools[len(parts) - 1] = ThreadPoolExecutor(
                len(parts) - 1, thread_name_prefix="swiftlite-batch")
        futures = [pool.submit(one, i) for i in range(1, len(parts))]
    try:
        try:
            first = one(0)
        finally:
            errors = [f.exception() for f in futures]  # waits for every part
    finally:
        torch.set_num_threads(cores)
    for error in errors:
        if error is not None:
            raise error
    return [first] + [f.result() for f in futures]
