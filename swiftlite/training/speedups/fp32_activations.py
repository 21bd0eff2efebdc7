"""CPU mixed precision for LoRA: frozen weights in bf16, everything that learns in fp32.

`--torch_dtype bfloat16` loads the frozen base in bf16 (half the memory, AMX / AVX-512-BF16
matmuls) and peft keeps the LoRA weights, hence their gradients and AdamW state, in fp32.
Left at that, every activation is bf16 too, and a LoRA update smaller than bf16's resolution
(~0.4% of the base output) is rounded away when it is added to the base output: early in
training the adapters barely change the forward pass and the loss falls more slowly than in
fp32 (seen on SmolLM2-135M: +1% loss after 4 steps). Here each frozen Linear casts its input
to bf16, multiplies in bf16, and returns fp32, so the residual stream, norms, attention, the
LoRA sums and the loss stay fp32 while the matmuls that dominate the cost run in bf16
(what autocast does on GPUs, without casting the weights on every call). Fused LoRA layers
(fused_lora.py) do the same for their base matmul themselves: its bf16 output is cast to fp32
once and the adapter branch is accumulated into it (and with --bf16_lora_matmuls the adapter's
own products read the same bf16 copy of the input).
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def _bf16_matmul_fp32_out(self, x):
    return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(torch.float32)


def fp32_activations(model) -> int:
    """Patch the frozen 16-bit Linear layers of `model` in place; returns how many."""
    n = 0
    for module in model.modules():
        if (type(module) is torch.nn.Linear and module.weight.dtype == torch.bfloat16
                and not module.weight.requires_grad):
            module.forward = types.MethodType(_bf16_matmul_fp32_out, module)
            n += 1
    if n and hasattr(model, "get_input_embeddings"):  # the residual stream starts in fp32 too
        model.get_input_embeddings().register_forward_hook(lambda _m, _i, out: out.float())
    return n


def wants_fp32_activations(model, args, device: str = "cpu") -> bool:
    """On a CPU, for LoRA on a bf16 base (GPUs get mixed precision from the Trainer's autocast).
    `device`: where the model will train (it is loaded on the CPU either way)."""
    return (args.fp32_activations and args.train_type == "lora"
            and getattr(model, "dtype", None) == torch.bfloat16 and device == "cpu")
