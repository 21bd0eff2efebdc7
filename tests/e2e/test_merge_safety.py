"""merge-lora never merges into a base the adapter was not trained on without being told, and
never deletes a folder it did not write (issue #41); on the session's tiny-qwen2 run."""
import os

import pytest

import swiftlite
from swiftlite import cli


@pytest.fixture(scope="module")
def other_bases():
    from swiftlite.models.builtin import build
    return {name: build(name) for name in ("tiny-qwen3", "tiny-qwen2.5")}


def test_an_adapter_is_not_merged_into_another_base_unless_asked(tiny_run, other_bases,
                                                                 tmp_path, capsys):
    """Before: an adapter trained on tiny-qwen2 merged into tiny-qwen3 or tiny-qwen2.5 (whose
    tensors have the same shapes) without a word."""
    ckpt = tiny_run.last_checkpoint
    for name, reason in (("tiny-qwen3", "architectures"), ("tiny-qwen2.5", "num_attention_heads")):
        out = tmp_path / name
        rc = cli.main(["merge-lora", "--ckpt_dir", ckpt, "--model", name, "--output_dir",
                       str(out), "--verify", "false"])
        err = capsys.readouterr().err
        assert rc == 2 and "tiny-qwen2" in err and name in err and reason in err, err
        assert "--allow_base_mismatch true" in err and not out.exists()
    # Told: merged, with the difference in a warning.
    out = swiftlite.merge_lora(ckpt, str(tmp_path / "meant"), model="tiny-qwen2.5",
                               allow_base_mismatch=True, verify=False)
    assert os.path.isfile(os.path.join(out, "config.json"))
    assert "num_attention_heads" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["meant"]
