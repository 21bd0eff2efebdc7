"""Shared by the speed-up tests: a LoRA model of tiny-qwen2 with given speed-ups, real
encoded samples, gradients and their comparison, and a short real sft run."""
from __future__ import annotations

import json
import os

import torch

from swiftlite.config.arguments import SftArguments


def _lora_model(model_dir, dtype="float32", gradient_checkpointing=True, seed=0, attn_impl=None,
                fp32_activations=True, lora_dropout=0.0, fast_dropout=True,
                selective_checkpointing=False, fused_lora=True, bf16_lora_matmuls=True,
                keep_attention=True, onednn_fp32=False):
    from swiftlite.models.loader import load_model
    from swiftlite.training.tuners import prepare_model
    torch.manual_seed(seed)
    args = SftArguments(model="x", dataset=["x"], lora_dropout=lora_dropout, attn_impl=attn_impl,
                        fast_dropout=fast_dropout, selective_checkpointing=selective_checkpointing,
                        fused_lora=fused_lora, bf16_lora_matmuls=bf16_lora_matmuls,
                        keep_attention=keep_attention, onednn_fp32=onednn_fp32,
                        gradient_checkpointing=gradient_checkpointing,
                        fp32_activations=fp32_activations)
    model = prepare_model(load_model(model_dir, dtype), args)
    for name, p in model.named_parameters():  # lora_B starts at 0: give the adapters a say
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    model.train()
    return model


def _samples(model_dir):
    from swiftlite.models.loader import load_tokenizer
    from swiftlite.data.template import get_template
    tok = load_tokenizer(model_dir)
    tpl = get_template("qwen", tok)
    convs = [[{"role": "user", "content": "What is 2+2?"},
              {"role": "assistant", "content": "2+2 is 4, as everyone knows."}],
             [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "Capital of France?"},
              {"role": "assistant", "content": "Paris."},
              {"role": "user", "content": "And of Italy? Tell me more about it, please."},
              {"role": "assistant", "content": "Rome, the capital since 1871."}],
             [{"role": "user", "content": "Name three colours."},
              {"role": "assistant", "content": "Red, green and blue."}]]
    return tok, [tpl.encode(c) for c in convs]


def _batch(model_dir):
    """(tokenizer, samples, their padding-free batch)."""
    from swiftlite.training.trainer import collator
    tok, samples = _samples(model_dir)
    return tok, samples, collator(tok, True)([dict(s) for s in samples])


def _step(model, batch, calls: list, seed: int):
    """One seeded forward and backward: (loss, LoRA gradients, matmul calls counted)."""
    torch.manual_seed(seed)
    model.zero_grad()
    calls.clear()
    loss = model(**batch).loss
    loss.backward()
    return loss.item(), _grads(model), len(calls)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _assert_close_grads(a, b, rtol=1e-4):
    assert a.keys() == b.keys() and a
    for n in a:
        scale = a[n].abs().max().item()
        assert scale > 0, f"{n} got no gradient"
        assert (a[n] - b[n]).abs().max().item() <= rtol * scale + 1e-12, n



def _run(tmp_path, name, data, **kw):
    import swiftlite
    res = swiftlite.sft(model="tiny-qwen2", dataset=[data], max_steps=2, logging_steps=1,
                        learning_rate=1e-2, lora_dropout=0.0, warmup_ratio=0.0,
                        save_strategy="no", report_to="none", output_dir=str(tmp_path / name),
                        **{"torch_dtype": "float32", **kw})  # exact sums; bf16 rounds per batch
    return [json.loads(line) for line in open(os.path.join(res.output_dir, "logging.jsonl"))
            if '"loss"' in line]


