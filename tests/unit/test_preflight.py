"""#40's pre-flight checks: each fires on a case made to fail and stays silent on a good one."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def template():
    from swiftlite.data.template import get_template
    from swiftlite.models.builtin import build
    from swiftlite.models.loader import load_tokenizer
    tokenizer = load_tokenizer(build("tiny-qwen2.5"))
    return get_template(None, tokenizer)


def _conversation(reply_words: int) -> list:
    return [{"role": "user", "content": "Tell me about rivers."},
            {"role": "assistant", "content": " ".join(["water"] * reply_words)}]


def test_end_of_turn_trained_in_every_sample_or_counted(template, capfd):
    """Cut from the right at --max_length, long samples lose their last reply's end-of-turn
    token: counted as such; samples that fit (or deleted ones) leave nothing to say."""
    from swiftlite.data.encode import encode_dataset, warn_if_end_of_turn_untrained
    convs = [_conversation(5), _conversation(5), _conversation(200), _conversation(300)]
    ds, _ = encode_dataset(convs, template, max_length=64, truncation_strategy="right",
                           use_cache=False)
    capfd.readouterr()
    assert warn_if_end_of_turn_untrained(ds, template, 64) == 2
    err = capfd.readouterr().err
    assert "2 of 4 samples do not end with a trained end-of-turn token" in err
    assert "2 of them reach --max_length 64" in err
    ds, _ = encode_dataset(convs, template, max_length=64, truncation_strategy="delete",
                           use_cache=False)
    assert warn_if_end_of_turn_untrained(ds, template, 64) == 0
    assert "end-of-turn" not in capfd.readouterr().err
