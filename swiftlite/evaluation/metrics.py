"""Scores of generated answers against references, computed by the libraries the field uses:
ROUGE-1/2/L F-measure by `rouge-score`, BLEU-4 by `sacrebleu`. rouge-score's own tokenizer
keeps only ASCII letters and digits, so a pair (reference and answer) with any other letter is
cut into words by `jieba` and lower-cased on both sides (as ms-swift and LLaMA-Factory cut all
text); BLEU needs word boundaries, so a pair with Chinese characters reaches sacrebleu as
jieba's words. Each pair is decided once for both sides: the same word must match itself.

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


def beyond_ascii(text: str) -> bool:
    """A letter or digit rouge-score's own tokenizer would drop."""
    return any(not c.isascii() and c.isalnum() for c in text)


class Words:
    """jieba's words, lower-cased: rouge-score's tokenizer for a pair beyond ASCII."""

    def tokenize(self, text: str) -> list[str]:
        return [w.lower() for w in cjk_words(text)]


def bleu_texts(hyp: str, ref: str) -> tuple[str, str]:
    """What sacrebleu reads: a pair with Chinese text as jieba's words joined by spaces, others
    as is (its default 13a tokenizer splits them)."""
    if has_cjk(hyp) or has_cjk(ref):
        return " ".join(cjk_words(hyp)), " ".join(cjk_words(ref))
    return hyp, ref


def text_scores(responses: list[str], references: list[str]) -> list[dict]:
    """One dict per row: ROUGE, sentence BLEU-4, exact match after stripping whitespace (a
    set's figures are report.summarize's)."""
    import sacrebleu
    from rouge_score import rouge_scorer
    ascii_scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES))
    words_scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), tokenizer=Words())
    rows = []
    for hyp, ref in zip(responses, references):
        scorer = words_scorer if beyond_ascii(hyp) or beyond_ascii(ref) else ascii_scorer
        rouge = scorer.score(ref, hyp)  # (target, prediction)
        row = {k: 100 * rouge[k].fmeasure for k in ROUGE_TYPES}
        bleu_hyp, bleu_ref = bleu_texts(hyp, ref)
        row["bleu4"] = sacrebleu.sentence_bleu(bleu_hyp, [bleu_ref]).score
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
            "tool_call": float(len(got) == len(want) and all(
                g[0] == w[0] and same_json(g[1], w[1]) for g, w in zip(got, want)))}


def same_json(a, b) -> bool:
    """Equal as JSON values: Python's True == 1 and False == 0 are not (1 and 1.0 are)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b))
    return type(a) in (int, float) and type(b) in (int, float) and a == b or (
        type(a) is type(b) and a == b)
