"""Encode preference rows (data.pairs) for `swiftlite rlhf`, through data.encode's machinery
(chunks in worker processes, Arrow files, the on-disk cache, the counts).

A pair is stored as chosen_input_ids / chosen_labels / rejected_input_ids / rejected_labels,
both starting with the same prompt ids (ChatTemplate.encode_replies), plus prompt_length and
length (the pair's tokens: what a batch costs). An unpaired (KTO) row is input_ids / labels /
prompt_length / label (1 desirable, 0 undesirable) / length.

max_length applies to each sequence (prompt + reply). Over it, --truncation_strategy delete
drops the row, right cuts the replies' ends, left cuts the prompt's start; every case is
counted. A pair whose chosen reply equals its rejected one is counted (it teaches nothing).
"""
from __future__ import annotations

from swiftlite.config.constants import IGNORE_INDEX
from swiftlite.data.encode import Counts, Encoder, count_rejected, encode_dataset, show_sample
from swiftlite.data.template_base import ChatTemplate

IDENTICAL = "identical chosen and rejected (kept; they teach nothing)"


def _fit(prompt: list[int], replies: list[dict], max_length: int, strategy: str,
         part: Counts) -> tuple[list[int], list[dict]] | None:
    """(prompt ids, replies) within max_length per sequence, or None when dropped (counted)."""
    longest = max(len(r["input_ids"]) for r in replies)
    if len(prompt) + longest > max_length:
        keep = max_length - longest  # prompt tokens left when the replies stay whole
        if strategy == "right" and len(prompt) < max_length:
            room = max_length - len(prompt)
            replies = [{k: v[:room] for k, v in r.items()} for r in replies]
        elif strategy == "left" and keep > 0:
            prompt = prompt[len(prompt) - keep:]
        else:
            part.dropped[f"longer than max_length {max_length}"] += 1
            return None
        part.truncated += 1
    trained = [len(r["labels"]) - r["labels"].count(IGNORE_INDEX) for r in replies]
    if min(trained) == 0:
        part.dropped["no trained tokens (reply cut off or empty)"] += 1
        return None
    part.trained_tokens += sum(trained)
    return prompt, replies


def _fitted(chunk: list, template: ChatTemplate, max_length: int, strategy: str, name: str,
            replies: tuple[str, ...]):
    """([(row, prompt ids, its encoded replies)] of the rows that render and fit, Counts)."""
    part = Counts(samples=len(chunk))
    requests = [{**c, "replies": [c[k] for k in replies]} for c in chunk]
    out = []
    for conv, enc in zip(chunk, template.encode_replies(requests)):
        if isinstance(enc, Exception):
            count_rejected(part, conv, name, template, enc)
            continue
        fitted = _fit(enc["prompt_ids"], enc["replies"], max_length, strategy, part)
        if fitted is not None:
            out.append((conv, *fitted))
    return out, part


def _pair_chunk(chunk: list, template: ChatTemplate, max_length: int, strategy: str, name: str):
    rows, part = _fitted(chunk, template, max_length, strategy, name, ("chosen", "rejected"))
    cols = {k: [] for k in PAIR_ENCODER.columns}
    for _, prompt, (chosen, rejected) in rows:
        if chosen["input_ids"] == rejected["input_ids"]:
            part.dropped[IDENTICAL] += 1  # reported with the drops; the pair stays
        masked = [IGNORE_INDEX] * len(prompt)
        for key, r in (("chosen", chosen), ("rejected", rejected)):
            cols[f"{key}_input_ids"].append(prompt + r["input_ids"])
            cols[f"{key}_labels"].append(masked + r["labels"])
        cols["prompt_length"].append(len(prompt))
        cols["length"].append(2 * len(prompt) + len(chosen["input_ids"]) +
                              len(rejected["input_ids"]))
    part.lengths += cols["length"]
    return (cols if cols["length"] else None), part


def _unpaired_chunk(chunk: list, template: ChatTemplate, max_length: int, strategy: str,
                    name: str):
    rows, part = _fitted(chunk, template, max_length, strategy, name, ("completion",))
    cols = {k: [] for k in UNPAIRED_ENCODER.columns}
    for conv, prompt, (reply,) in rows:
        cols["input_ids"].append(prompt + reply["input_ids"])
        cols["labels"].append([IGNORE_INDEX] * len(prompt) + reply["labels"])
        cols["prompt_length"].append(len(prompt))
        cols["label"].append(int(conv["label"]))
        cols["length"].append(len(prompt) + len(reply["input_ids"]))
    part.lengths += cols["length"]
    return (cols if cols["length"] else None), part


PAIR_ENCODER = Encoder("pair", {"chosen_input_ids": "ids", "chosen_labels": "ids",
                                "rejected_input_ids": "ids", "rejected_labels": "ids",
                                "prompt_length": "int", "length": "int"}, _pair_chunk)
UNPAIRED_ENCODER = Encoder("unpaired", {"input_ids": "ids", "labels": "ids",
                                        "prompt_length": "int", "label": "int",
                                        "length": "int"}, _unpaired_chunk)


def encode_preferences(rows, template: ChatTemplate, *, unpaired: bool, **kwargs):
    """(datasets.Dataset, EncodeReport) of pairs, or of unpaired rows for KTO; kwargs as
    data.encode.encode_dataset's."""
    return encode_dataset(rows, template, encoder=UNPAIRED_ENCODER if unpaired else PAIR_ENCODER,
                          **kwargs)


def show_pair(sample: dict, tokenizer) -> str:
    """One encoded pair (or unpaired row) as training sees it, with its label masks."""
    if "chosen_input_ids" not in sample:
        kind = "desirable" if sample["label"] else "undesirable"
        return f"{kind} completion, " + show_sample(sample, tokenizer)
    return "\n".join(f"{key}: " + show_sample({"input_ids": sample[f"{key}_input_ids"],
                                               "labels": sample[f"{key}_labels"]}, tokenizer)
                     for key in ("chosen", "rejected"))
