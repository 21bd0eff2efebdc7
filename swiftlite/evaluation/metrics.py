"""Scores of generated answers against references, computed by the libraries the field uses:
ROUGE-1/2/L F-measure by `rouge-score`, BLEU-4 by `sacrebleu`. Text with Chinese characters is
first cut into words by `jieba` (as ms-swift and LLaMA-Factory do): rouge-score's own
tokenizer keeps only ASCII letters and digits, and BLEU needs word boundaries.

ROUGE and BLEU are percentages (as the peers report them); shares (exact match, stopped, tool
calls) are fractions.
"""
from __future__ import annotations

import json
import re

_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


def has_cjk(text: str) -> bool:
    return bool(_CJK.search(text))


def cjk_words(text: str) -> list[str]:
    import logging

    import jieba
    jieba.setLogLevel(logging.WARNING)  # not its "Building prefix dict" lines on every run
    return [w for w in jieba.cut(text) if w.strip()]


class RougeTokenizer:
    """rouge-score's tokenizer, except for text with Chinese characters: jieba's words."""

    def __init__(self):
        from rouge_score.tokenizers import DefaultTokenizer
        self._default = DefaultTokenizer(use_stemmer=False)

    def tokenize(self, text: str) -> list[str]:
        return cjk_words(text) if has_cjk(text) else self._default.tokenize(text)


def bleu_text(text: str) -> str:
    """What sacrebleu reads: Chinese text as jieba's words joined by spaces, others as is (its
    default 13a tokenizer splits them)."""
    return " ".join(cjk_words(text)) if has_cjk(text) else text


def text_scores(responses: list[str], references: list[str]) -> list[dict]:
    """One dict per row: ROUGE, sentence BLEU-4, exact match after stripping whitespace (a
    set's figures are report.summarize's)."""
    import sacrebleu
    from rouge_score import rouge_scorer
    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), tokenizer=RougeTokenizer())
    rows = []
    for hyp, ref in zip(responses, references):
        rouge = scorer.score(ref, hyp)  # (target, prediction)
        row = {k: 100 * rouge[k].fmeasure for k in ROUGE_TYPES}
        row["bleu4"] = sacrebleu.sentence_bleu(bleu_text(hyp), [bleu_text(ref)]).score
        row["exact_match"] = float(hyp.strip() == ref.strip())
        rows.append(row)
    return rows


def _calls(calls: list[dict] | None) -> list[tuple[str, object]]:
    """(name, arguments as a JSON value) of each call; arguments that are not JSON stay text."""
    out = []
    for c in calls or []:
        fn = c.get("function", c)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        out.append((fn.get("name"), args))
    return out


def tool_call_scores(predicted: list[dict] | None, reference: list[dict] | None) -> dict:
    """For a row that offers tools: did the model call the same functions (`tool_call_name`),
    with the same arguments compared as JSON (`tool_call`)? Calling none where the reference
    answers in text is right; calling one there is wrong."""
    got, want = _calls(predicted), _calls(reference)
    return {"tool_call_name": float([n for n, _ in got] == [n for n, _ in want]),
            "tool_call": float(got == want)}
