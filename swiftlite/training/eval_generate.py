"""--eval_generate: at each evaluation, the model answers the validation rows and its answers
are scored as `swiftlite eval` scores them (ROUGE, BLEU-4, exact match, stopped); the figures
join eval_loss in logging.jsonl and TensorBoard, and --metric_for_best_model may name them.

The rows are read back from their training encoding, whatever the data path was (cached,
packed per row, streamed): the prompt is every token before the last trained span, the
reference is that span, and the span's last token (the template's end of turn) stops
generation.
"""
from __future__ import annotations

from transformers import TrainerCallback

from swiftlite.config.constants import IGNORE_INDEX
from swiftlite.log import is_main_process


def last_reply(input_ids: list[int], labels: list[int]) -> tuple[list[int], list[int]] | None:
    """(prompt ids, reference ids) of an encoded row: the last run of trained tokens."""
    end = max((i for i, y in enumerate(labels) if y != IGNORE_INDEX), default=None)
    if end is None:
        return None
    start = end
    while start > 0 and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    return input_ids[:start], input_ids[start:end + 1]


# what is logged at each evaluation, as eval_<name> (swiftlite eval's names)
LOGGED = ("rouge1", "rouge2", "rougeL", "exact_match", "bleu4", "stopped")


class GenerationMetrics(TrainerCallback):
    """Scores greedy answers to the validation rows at each evaluation (main process)."""

    def __init__(self, val_ds, tokenizer, max_new_tokens: int, batch: int):
        self.tokenizer, self.max_new_tokens, self.batch = tokenizer, max_new_tokens, batch
        self.rows = [r for r in (last_reply(list(x["input_ids"]), list(x["labels"]))
                                 for x in val_ds) if r is not None and r[0]]
        # the end-of-turn tokens the rows were trained to write, and the tokenizer's EOS
        self.stops = sorted({ref[-1] for _, ref in self.rows} |
                            ({tokenizer.eos_token_id} - {None}))
        self.trainer = None  # set by build_trainer: metrics are logged through it
        self.refs = [self.text(ref) for _, ref in self.rows]

    def text(self, ids: list[int]) -> str:
        """What is scored of a reply: its text without its reasoning (a Qwen3 template's think
        block opens every trained reply), as `swiftlite eval` scores it."""
        from swiftlite.data.tools import parse_reply
        decoded = self.tokenizer.decode(ids, skip_special_tokens=True)
        return parse_reply(decoded, self.tokenizer.chat_template)["content"].strip()

    def on_evaluate(self, args, state, control, metrics=None, model=None, **kwargs):
        if not is_main_process() or not self.rows or model is None:
            return
        from swiftlite.evaluation.metrics import text_scores
        from swiftlite.evaluation.report import summarize
        answers = self._generate(model)
        scored = text_scores([a for a, _, _ in answers], self.refs)
        rows = [{"response": a, "reference": r, "finish_reason": f, "tokens": n, **s}
                for (a, f, n), r, s in zip(answers, self.refs, scored)]
        total = summarize(rows)
        scores = {f"eval_{k}": round(total[k], 4) for k in LOGGED}
        if metrics is not None:
            metrics.update(scores)  # seen by early stopping and by the best-checkpoint choice
        if self.trainer is not None:
            self.trainer.log(scores)

    def _generate(self, model) -> list[tuple[str, str, int]]:
        """(the greedy answer, how it ended: "stop" or "length", its tokens) per row."""
        import torch
        pad = self.tokenizer.pad_token_id
        device = next(model.parameters()).device
        answers = [None] * len(self.rows)
        order = sorted(range(len(self.rows)), key=lambda i: -len(self.rows[i][0]))
        was_training = model.training
        model.eval()
        try:
            for s in range(0, len(order), self.batch):
                idx = order[s:s + self.batch]
                width = max(len(self.rows[i][0]) for i in idx)
                ids = torch.tensor([[pad] * (width - len(self.rows[i][0])) + self.rows[i][0]
                                    for i in idx], device=device)
                mask = (torch.arange(width, device=device)[None] >= torch.tensor(
                    [width - len(self.rows[i][0]) for i in idx], device=device)[:, None]).long()
                with torch.inference_mode():
                    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                         max_new_tokens=self.max_new_tokens,
                                         eos_token_id=self.stops, pad_token_id=pad)
                for row, i in zip(out[:, width:].tolist(), idx):
                    cut = next((k for k, t in enumerate(row) if t in self.stops), None)
                    answers[i] = (self.text(row[:cut]), "length" if cut is None else "stop",
                                  len(row[:cut]))
        finally:
            model.train(was_training)
        return answers
