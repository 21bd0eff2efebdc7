"""Teacher-forced scores of a model: the loss of reference replies with the training encoding,
and the log-likelihood of each option of a multiple-choice question."""
from __future__ import annotations

from typing import Callable

from swiftlite.config.constants import IGNORE_INDEX


def _forward_batches(model, device: str, seqs: list[list[int]], pad: int, batch: int,
                     use: Callable) -> None:
    """Runs the model on seqs, `batch` at a time (right padding), calling use(i, logprobs)
    with each sequence's log-softmax over the vocabulary (a [len, vocab] float32 tensor)."""
    import torch
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))  # little padding per batch
    for start in range(0, len(order), batch):
        idx = order[start:start + batch]
        width = max(len(seqs[i]) for i in idx)
        ids = torch.tensor([seqs[i] + [pad] * (width - len(seqs[i])) for i in idx], device=device)
        mask = torch.tensor([[1] * len(seqs[i]) + [0] * (width - len(seqs[i])) for i in idx],
                            device=device)
        with torch.inference_mode():
            logits = model(input_ids=ids, attention_mask=mask).logits
        for row, i in enumerate(idx):
            use(i, torch.log_softmax(logits[row, :len(seqs[i])].float(), dim=-1))


def reply_losses(model, template, device: str, conversations: list[dict], batch: int = 8
                 ) -> list[tuple[float, int]]:
    """(summed negative log-likelihood, trained tokens) per conversation, over the tokens the
    training encoding trains (the same labels `swiftlite sft` computes its loss on)."""
    encoded = template.encode_batch(conversations)
    for e in encoded:
        if isinstance(e, Exception):
            raise e
    out: list[tuple[float, int] | None] = [None] * len(encoded)

    def use(i, logprobs):
        labels = encoded[i]["labels"][1:]  # position t predicts token t + 1
        picked = [(t, y) for t, y in enumerate(labels) if y != IGNORE_INDEX]
        out[i] = (-sum(float(logprobs[t, y]) for t, y in picked), len(picked))
    _forward_batches(model, device, [e["input_ids"] for e in encoded],
                     template.tokenizer.pad_token_id, batch, use)
    return out


def option_logprobs(model, device: str, prompts: list[list[int]], options: list[list[list[int]]],
                    pad: int, batch: int = 8) -> list[list[float]]:
    """For each prompt, the summed log-probability of each option's tokens following it. When
    every option of a prompt is one token (the letters A-D), one pass over the prompt scores
    them all."""
    seqs, owners = [], []  # (prompt index, option index or None for all single-token options)
    for p, (prompt, opts) in enumerate(zip(prompts, options)):
        if all(len(o) == 1 for o in opts):
            seqs.append(prompt)
            owners.append((p, None))
        else:
            for k, o in enumerate(opts):
                seqs.append(prompt + o)
                owners.append((p, k))
    out = [[0.0] * len(o) for o in options]

    def use(i, logprobs):
        p, k = owners[i]
        n = len(prompts[p])
        if k is None:
            for j, (tok,) in enumerate(options[p]):
                out[p][j] = float(logprobs[n - 1, tok])
        else:
            out[p][k] = sum(float(logprobs[n - 1 + t, tok]) for t, tok in enumerate(options[p][k]))
    _forward_batches(model, device, seqs, pad, batch, use)
    return out
