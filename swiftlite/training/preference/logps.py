"""Per-sequence log-probabilities of the trained tokens, for preference losses.

A batch holds several sequences (a pair's chosen and rejected replies, or KTO's rows) either
padding-free in one row (position ids restart per sequence, as SFT's batches) or padded, with
`seq_ids` saying which sequence each position belongs to (-1: padding). The decoder runs as
usual (through DeepSpeed and peft wrappers) with the LM head switched off; the head and the
log-softmax then run only at the trained positions, one chunk of rows at a time, each chunk
recomputed in backward rather than kept (torch.utils.checkpoint): no length x vocabulary
logits are ever held, as in SFT's chunked loss. Where that path does not apply (ZeRO-3
partitions the head; a head with LoRA) the model's own logits are used.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from swiftlite.config.constants import IGNORE_INDEX, LOSS_CHUNK_ROWS
from swiftlite.training.speedups.chunked_loss import (decoder_output, matmul_dtype,
                                                      shifted_targets, unwrap, why_unsupported)

MODEL_KEYS = ("input_ids", "position_ids", "attention_mask")


def _chunk_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
    # fp32 log-probabilities, like the model's own loss (16-bit logits upcast first). The
    # head's product through autograd: oneDNN's fp32 linear (training.speedups.onednn_fp32)
    # has no backward, and here autograd differentiates it (SFT's chunked loss computes its
    # gradient itself).
    mm = matmul_dtype(hidden, weight)
    logits = F.linear(hidden.to(mm), weight.to(mm)).float()
    return torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]


def token_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk: int = LOSS_CHUNK_ROWS) -> torch.Tensor:
    """log softmax(hidden @ weight.T)[targets], row by row, in chunks of `chunk` rows."""
    parts = []
    for start in range(0, hidden.shape[0], chunk):
        h, y = hidden[start:start + chunk], targets[start:start + chunk]
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            parts.append(checkpoint(_chunk_logps, h, weight, y, use_reentrant=False))
        else:
            parts.append(_chunk_logps(h, weight, y))
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


def sequence_logps(model, batch: dict, num_sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of log-probs of each sequence's trained tokens, their count), per sequence."""
    targets = shifted_targets(batch["labels"])
    keep = targets != IGNORE_INDEX
    seq = batch["seq_ids"][keep]
    inputs = {k: batch[k] for k in MODEL_KEYS if k in batch}
    if why_unsupported(model) is None:
        per_token = token_logps(decoder_output(model, inputs)[keep],
                                unwrap(model).get_output_embeddings().weight, targets[keep])
    else:
        logits = model(**inputs, use_cache=False).logits
        per_token = torch.log_softmax(logits[keep].float(), -1).gather(
            1, targets[keep][:, None])[:, 0]
    sums = torch.zeros(num_sequences, dtype=per_token.dtype, device=per_token.device)
    sums = sums.index_add(0, seq, per_token)
    counts = torch.bincount(seq, minlength=num_sequences)
    return sums, counts
