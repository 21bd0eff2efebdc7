"""--fp32_activations / --torch_dtype bfloat16 on a CPU: bf16 frozen base, LoRA and optimizer
in fp32; GPU runs keep peft's layers and torch's precision."""
from __future__ import annotations


import pytest
import torch

from swiftlite.config.arguments import SftArguments

from helpers.marks import slow_bf16_math
from helpers.speedups import _batch, _lora_model


@slow_bf16_math
def test_cpu_mixed_precision_keeps_trainables_fp32(tiny_qwen2):
    """--torch_dtype bfloat16 on CPU: frozen base weights bf16, LoRA weights fp32 (so AdamW's
    state is fp32 too), activations fp32 (--fp32_activations, default) so the LoRA sums are not
    rounded to bf16; the loss then matches fp32 more closely than with all-bf16 activations."""
    from swiftlite.training.speedups.chunked_loss import supervised_head_loss
    tok, samples, batch = _batch(tiny_qwen2)
    losses = {}
    for dtype, fp32_act in (("float32", True), ("bfloat16", True), ("bfloat16", False)):
        model = _lora_model(tiny_qwen2, dtype, fp32_activations=fp32_act)
        trainable = [p for p in model.parameters() if p.requires_grad]
        frozen = [p for p in model.parameters() if not p.requires_grad]
        assert {p.dtype for p in trainable} == {torch.float32}
        assert {p.dtype for p in frozen} == {getattr(torch, dtype)}
        seen = []
        hook = model.get_base_model().model.layers[0].register_forward_hook(
            lambda _m, _i, out: seen.append(out[0] if isinstance(out, tuple) else out))
        losses[dtype, fp32_act] = model(**batch).loss.item()
        hook.remove()
        assert seen[0].dtype == (torch.float32 if fp32_act else torch.bfloat16)
        assert supervised_head_loss(model, batch).item() == pytest.approx(
            losses[dtype, fp32_act], rel=1e-3)
        if dtype == "bfloat16":
            opt = torch.optim.AdamW(trainable, lr=1e-3)
            model(**batch).loss.backward()
            opt.step()
            assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())
    ref = losses["float32", True]
    assert abs(losses["bfloat16", True] - ref) < abs(losses["bfloat16", False] - ref)
    assert losses["bfloat16", True] == pytest.approx(ref, rel=1e-3)


def test_gpu_runs_keep_peft_layers_and_torch_precision(tiny_qwen2):
    """sft loads the model on the CPU and the Trainer moves it to the GPU later, so prepare_model
    is told the training device: for a GPU neither fused LoRA layers nor the CPU's
    fp32-activation patch, and --selective_checkpointing goes through torch's policy. (No GPU
    here: only the device name is passed; nothing runs on it.)"""
    from peft.tuners.lora.layer import Linear
    from transformers.modeling_layers import GradientCheckpointingLayer

    from swiftlite.models.loader import load_model
    from swiftlite.training.tuners import prepare_model
    args = SftArguments(model="x", dataset=["x"], selective_checkpointing=True)
    for device, fused in (("cuda", False), ("cpu", True)):
        model = prepare_model(load_model(tiny_qwen2, "bfloat16"), args, device)
        lora = [m for m in model.modules() if isinstance(m, Linear)]
        assert lora and all(("_peft_forward" in vars(m)) == fused for m in lora)
        patched = [m for m in model.modules()
                   if type(m) is torch.nn.Linear and "forward" in vars(m)]  # fp32 activations
        assert bool(patched) == fused
        block = next(m for m in model.modules() if isinstance(m, GradientCheckpointingLayer))
        policy = "context_fn" in block._gradient_checkpointing_func.keywords
        assert policy == (not fused)


