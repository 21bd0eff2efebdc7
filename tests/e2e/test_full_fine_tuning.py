"""Full fine-tuning under 16-bit compute keeps fp32 master weights (runtime/hardware.py:
weights_dtype). In bf16 weights, AdamW's steps (about the learning rate) below half of bf16's
resolution at a weight are rounded away, and weights near 1 (the norms) never move
(docs/reliability.md)."""
from __future__ import annotations

import glob
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.cli import run_cli, write_jsonl
from tests.helpers.marks import needs_bf16_units


@needs_bf16_units
def test_full_fine_tuning_in_bf16_moves_every_weight(tmp_path):
    r = run_cli("sft", "--model", "tiny-qwen2", "--dataset", "self-cognition#32",
                "--train_type", "full", "--torch_dtype", "bfloat16", "--learning_rate", "1e-5",
                "--max_steps", "4", "--save_steps", "4", "--logging_steps", "1",
                "--report_to", "none", "--output_dir", tmp_path,
                env={"HF_HUB_OFFLINE": "1"})
    from swiftlite.models import resolve_model
    from swiftlite.models.loader import load_model
    base = load_model(resolve_model("tiny-qwen2")[0], "float32").state_dict()
    trained = load_file(glob.glob(f"{tmp_path}/*/checkpoint-4/model.safetensors")[0])
    assert {t.dtype for t in trained.values()} == {torch.float32}
    still = {k: (v == base[k]).sum().item() for k, v in trained.items()}
    embedding = "model.embed_tokens.weight"
    # a few embedding entries of rare tokens, whose gradient underflowed to 0 in bf16
    assert still.pop(embedding) <= trained[embedding].numel() // 10_000
    assert sum(still.values()) == 0, {k: n for k, n in still.items() if n}
    assert any(k.endswith("norm.weight") for k in still)  # weights near 1 moved too
    assert "fp32 master weights, bfloat16 compute by autocast" in r.stderr + r.stdout


@needs_bf16_units
def test_full_fine_tuning_dpo_computes_its_reference_as_it_trains(tmp_path):
    """DPO's reference for full fine-tuning is the starting model, computed once before
    training: under the same bf16 autocast as the policy's steps over the fp32 masters (in
    fp32 it would differ from the policy's first step by the precision alone, and on a GPU run
    several times slower)."""
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}],
             "chosen": [{"role": "assistant", "content": f"{a} plus {b} is {a + b}."}],
             "rejected": [{"role": "assistant", "content": "I would rather not say."}]}
            for a in range(4) for b in range(4)]
    pairs = write_jsonl(tmp_path / "p.jsonl", rows)
    r = run_cli("rlhf", "--model", "tiny-qwen2", "--dataset", pairs,
                "--rlhf_type", "dpo", "--train_type", "full", "--torch_dtype", "bfloat16",
                "--max_steps", "1", "--logging_steps", "1", "--report_to", "none",
                "--save_strategy", "no", "--output_dir", tmp_path / "out",
                "--load_from_cache_file", "false",  # computed here, not found in the cache
                env={"HF_HUB_OFFLINE": "1"})
    log = r.stderr + r.stdout
    assert "(the model as it starts, bfloat16 by autocast as in training)" in log
    with open(next((tmp_path / "out").iterdir()) / "logging.jsonl") as f:
        first = json.loads(f.readline())
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-3)  # policy = reference
