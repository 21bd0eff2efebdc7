"""Causal-LM loss computed only where it counts, in chunks ("supervised-head" loss).

The plain path projects every position onto the vocabulary: for Qwen2 (151,936 tokens) the
fp32 logits of one 2048-token row are 1.2 GB, plus their gradient, and most of those
positions are prompt tokens whose labels are -100 anyway. Here the decoder's last hidden
states are gathered at the supervised positions only, and the LM head + cross-entropy run
chunk by chunk; each chunk's gradient with respect to the hidden states is computed in the
same pass (softmax - one_hot), so no logits are kept for backward and none are recomputed.
Peak memory is one chunk of logits instead of length x vocab.

The numbers are the model's own: same head weight, logits upcast to fp32 before the softmax
like transformers' ForCausalLMLoss, sum over trained tokens divided by the Trainer's
`num_items_in_batch` (trained tokens across the whole accumulated batch) when given.
"""
from __future__ import annotations

import inspect
import threading

import torch
import torch.nn.functional as F

from swiftlite.config.constants import IGNORE_INDEX, LOSS_CHUNK_ROWS as CHUNK
from swiftlite.training.speedups import onednn_fp32
from swiftlite.training.speedups.batch_threads import share


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_i CE(h_i @ W^T, y_i) with the gradients computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.weight_dtype = weight.dtype
        weight = weight.to(matmul_dtype(hidden, weight))
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if need_w else None
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start:start + chunk].to(weight.dtype), targets[start:start + chunk]
            logits = onednn_fp32.linear(h, weight)
            # fp32 log-probabilities (16-bit logits upcast, like the model's own loss) in place,
            # in the logits themselves when they are fp32: one chunk-sized buffer, where
            # logsumexp and the subtraction on an fp32 copy took three (150 MB at 256 rows of a
            # 49,152-token vocabulary) and new ones cost a page fault every 4 KB
            logp = logits.float()
            torch._log_softmax(logp, -1, False, out=logp)
            total -= logp.gather(1, y[:, None]).sum()
            g = None
            if need_h or need_w:
                # d(sum CE)/d logits = softmax - one_hot, in the head's dtype: from the 16-bit
                # logits by a kernel that computes in fp32, or in place of the fp32 ones
                if logp is logits:
                    g = logp.exp_()
                else:  # the fp32 buffer goes first: one chunk of 6 bytes per value at most
                    logp = None
                    g = torch.softmax(logits, dim=-1)
                g[torch.arange(len(y), device=y.device), y] -= 1
                if need_h:
                    grad_h[start:start + chunk] = onednn_fp32.mm(g, weight)
                if need_w:
                    grad_w += (g.t() @ h).float()
            # before the next chunk's logits exist (g may be these logits, computed in place)
            del logits, logp, g
        ctx.save_for_backward(grad_h, grad_w)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None
        gw = (grad_w * grad_out).to(ctx.weight_dtype) if grad_w is not None else None
        return gh, gw, None, None


def matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The head product's dtype: the narrower of the two. fp32 hidden states with a frozen
    bf16 head (fp32_activations.py): bf16, as the other frozen matmuls; 16-bit hidden states
    (a GPU's autocast) with a trained fp32 head copy (--modules_to_save): their 16 bits, as
    autocast runs the model's own head."""
    return hidden.dtype if hidden.dtype.itemsize < weight.dtype.itemsize else weight.dtype


def linear_cross_entropy(hidden, weight, targets, chunk: int = CHUNK):
    """Sum of token cross-entropies of `hidden @ weight.T` against `targets` (no -100 here)."""
    return _LinearCrossEntropy.apply(hidden, weight, targets, chunk)


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """targets[t] = labels[t + 1] (the token position t predicts), -100 at each row's end."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def unwrap(model):
    """The transformers *ForCausalLM inside DDP/DeepSpeed and peft wrappers."""
    while hasattr(model, "module"):
        model = model.module
    if hasattr(model, "get_base_model"):  # peft
        model = model.get_base_model()
    return model


def why_unsupported(model) -> str | None:
    """None when the supervised-head loss can replace this model's own loss; else the reason."""
    lm = unwrap(model)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if type(head).__name__ == "ModulesToSaveWrapper" and head.active_adapters:
        # --modules_to_save lm_head: peft's wrapper hands out its trained copy's weight
        head = head.modules_to_save[head.active_adapters[0]]
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return "the LM head is not a plain bias-free Linear (e.g. LoRA on lm_head)"
    if hasattr(head.weight, "ds_id"):
        return "DeepSpeed ZeRO-3 partitions the LM head weight"
    cfg = getattr(lm, "config", None)
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None):
        return "the model rescales its logits"
    if "logits_to_keep" not in inspect.signature(lm.forward).parameters:
        return "the model's forward has no logits_to_keep"
    if not hasattr(lm, "get_decoder"):
        return "the model has no get_decoder()"
    return None


def decoder_output(model, inputs: dict) -> torch.Tensor:
    """The decoder's last hidden states of `model` on `inputs` (no labels): the model runs as
    usual, through its wrappers, with its LM head projecting no position. Under an autocast
    that is on during the forward (accelerate's, around the model's forward only) they come
    in its dtype, as autocast would hand them to the head: the head runs after the forward,
    and fp32 hidden states over fp32 master weights (full fine-tuning) would multiply in fp32."""
    lm = unwrap(model)
    captured, thread = {}, threading.get_ident()

    def grab(_module, _args, output):
        if threading.get_ident() != thread:  # another part's forward (batch_threads.py)
            return
        h = output[0] if isinstance(output, tuple) else output.last_hidden_state
        if torch.is_autocast_enabled(h.device.type):
            h = h.to(torch.get_autocast_dtype(h.device.type))
        captured["h"] = h

    handle = lm.get_decoder().register_forward_hook(grab)
    try:
        no_positions = torch.zeros(inputs["input_ids"].shape, dtype=torch.bool,
                                   device=inputs["input_ids"].device)
        model(**inputs, logits_to_keep=no_positions, use_cache=False)
    finally:
        handle.remove()
    return captured["h"]


def supervised_head_loss(model, inputs: dict, num_items_in_batch=None, chunk: int = CHUNK):
    """The causal-LM loss of `model` on `inputs` (with labels), LM head at trained positions only.

    The model runs as usual (through its wrappers, so DeepSpeed and peft hooks apply) with
    `logits_to_keep` set to no position; a hook on the decoder keeps its last hidden state.
    """
    inputs = dict(inputs)
    targets = shifted_targets(inputs.pop("labels"))
    keep = targets != IGNORE_INDEX
    hidden = decoder_output(model, inputs)[keep]
    weight = unwrap(model).get_output_embeddings().weight
    # the parts of a --batch_threads step run their heads at once: together one chunk's rows
    total = linear_cross_entropy(hidden, weight, targets[keep], max(1, chunk // share()))
    denom = num_items_in_batch if num_items_in_batch is not None else keep.sum().clamp(min=1)
    if torch.is_tensor(denom):
        denom = denom.to(total.device)
    return total / denom
