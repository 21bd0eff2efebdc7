"""Batches of preference rows: every sequence of a batch (the pairs' chosen replies, then
their rejected ones; or KTO's rows) with `seq_ids` saying which sequence each position belongs
to, padding-free (one row, position ids restarting per sequence, as SFT's batches) or padded.

KTO's batches also carry, under `kl_`, each row's prompt followed by the previous row's
completion (TRL's mismatched pairs, rotated within the batch), whose log-probs estimate the
KL divergence between the policy and the reference."""
from __future__ import annotations

import torch

from swiftlite.config.constants import IGNORE_INDEX


def _sequences(sequences: list[tuple[list[int], list[int]]], padding_free: bool, pad_id: int,
               prefix: str = "") -> dict:
    if padding_free:
        ids, labels, pos, seq = [], [], [], []
        for i, (s, lab) in enumerate(sequences):
            ids += s
            # the first label of each sequence is never a target of the one before it
            labels += [IGNORE_INDEX] + list(lab[1:])
            pos += range(len(s))
            seq += [i] * len(s)
        out = {"input_ids": [ids], "labels": [labels], "position_ids": [pos], "seq_ids": [seq]}
    else:
        width = max(len(s) for s, _ in sequences)
        out = {"input_ids": [], "labels": [], "attention_mask": [], "seq_ids": []}
        for i, (s, lab) in enumerate(sequences):
            pad = width - len(s)
            out["input_ids"].append(list(s) + [pad_id] * pad)
            out["labels"].append(list(lab) + [IGNORE_INDEX] * pad)
            out["attention_mask"].append([1] * len(s) + [0] * pad)
            out["seq_ids"].append([i] * len(s) + [-1] * pad)
    return {prefix + k: torch.tensor(v, dtype=torch.long) for k, v in out.items()}


class PreferenceCollator:
    def __init__(self, pad_id: int, padding_free: bool = True):
        self.pad_id, self.padding_free = pad_id, padding_free

    def __call__(self, rows: list[dict]) -> dict:
        if "chosen_input_ids" in rows[0]:
            seqs = [(r["chosen_input_ids"], r["chosen_labels"]) for r in rows] + \
                   [(r["rejected_input_ids"], r["rejected_labels"]) for r in rows]
            batch = _sequences(seqs, self.padding_free, self.pad_id)
            for key in ("ref_chosen_logps", "ref_rejected_logps"):
                if key in rows[0]:
                    batch[key] = torch.tensor([r[key] for r in rows], dtype=torch.float32)
        else:
            seqs = [(r["input_ids"], r["labels"]) for r in rows]
            batch = _sequences(seqs, self.padding_free, self.pad_id)
            batch["label"] = torch.tensor([bool(r["label"]) for r in rows])
            kl = []
            for i, r in enumerate(rows):
                other = rows[i - 1]  # the previous row's completion (the last one's for row 0)
                p, q = r["prompt_length"], other["prompt_length"]
                kl.append((list(r["input_ids"][:p]) + list(other["input_ids"][q:]),
                           [IGNORE_INDEX] * p + list(other["labels"][q:])))
            batch.update(_sequences(kl, self.padding_free, self.pad_id, prefix="kl_"))
        batch["num_sequences"] = len(seqs)
        return batch
