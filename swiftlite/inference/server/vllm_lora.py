"""What vLLM cannot serve as a LoRA adapter, said by `deploy --infer_backend vllm` before its
server starts, with the way out (vLLM would otherwise fail at the first request for that
adapter, or at start-up, in its own words). The rules are vLLM's own (0.32:
vllm/lora/peft_helper.py `_validate_features`, and lora_model.py's target check: LoRA on
linear layers only), read from the adapter's config and its tensor names."""
from __future__ import annotations

import json
import os

from swiftlite.errors import UsageError

MAX_RANK = 512  # the largest --max-lora-rank vLLM takes (vllm_backend passes the smallest fit)
# inits that only set the adapter's first values: a saved adapter is a plain LoRA
PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")


def problems(adapter_dir: str) -> list[str]:
    """What in this adapter vLLM refuses ([]: nothing)."""
    with open(os.path.join(adapter_dir, "adapter_config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    out = []
    if cfg.get("use_dora"):
        out.append("DoRA (use_dora)")
    if cfg.get("lora_bias"):
        out.append("a bias on lora_B (lora_bias)")
    if cfg.get("modules_to_save"):
        out.append(f"modules trained whole (modules_to_save {' '.join(cfg['modules_to_save'])})")
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.lower() not in PLAIN_INITS:
        out.append(f"init_lora_weights {init} not converted for the original base")
    rank = max([int(cfg.get("r", 8)), *map(int, (cfg.get("rank_pattern") or {}).values())])
    if rank > MAX_RANK:
        out.append(f"rank {rank} (vLLM serves ranks up to {MAX_RANK})")
    path = os.path.join(adapter_dir, "adapter_model.safetensors")
    if os.path.exists(path):
        from safetensors import safe_open
        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
        embedded = sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n in names
                           if "lora_embedding_" in n or ".lm_head.lora_" in n})
        if embedded:
            out.append(f"LoRA on {' and '.join(embedded)} (vLLM adapts linear layers only)")
    return out


def check_adapters(adapters: dict[str, str]) -> None:
    """A UsageError naming every adapter (served name -> folder) vLLM cannot serve and why."""
    bad = {name: (path, p) for name, path in adapters.items() if (p := problems(path))}
    if not bad:
        return
    lines = [f"{path} ({name}): {', '.join(p)}" for name, (path, p) in bad.items()]
    first = next(iter(bad.values()))[0].rstrip("/")
    raise UsageError("--infer_backend vllm cannot serve these as LoRA adapters:\n  "
                     + "\n  ".join(lines) + f"\nMerge each first (swiftlite merge-lora "
                     f"--ckpt_dir {first}, then deploy --ckpt_dir {first}-merged "
                     "--infer_backend vllm), or serve it as it is with --infer_backend pt.")
