"""merge-lora never merges into a base the adapter was not trained on without being told, and
never deletes a folder it did not write (issue #41); on the session's tiny-qwen2 run."""
import os
import shutil

import pytest

import swiftlite
from swiftlite import cli
from swiftlite.errors import UsageError


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


def _listing(folder) -> list[str]:
    return sorted(os.path.relpath(os.path.join(b, n), folder) for b, ds, fs in os.walk(folder)
                  for n in ds + fs)


def test_exist_ok_replaces_only_an_earlier_merge(tiny_run, tmp_path, capsys):
    """Before: `--exist_ok true` deleted another run's args.json, checkpoints and logs, or a
    folder holding a user's thesis.txt, and put a merged model there (exit 0)."""
    ckpt = tiny_run.last_checkpoint
    run = tmp_path / "v0-20260101-000000"  # another run
    shutil.copytree(ckpt, run / "checkpoint-8")
    for name in ("args.json", "logging.jsonl"):
        shutil.copy(os.path.join(tiny_run.output_dir, name), run / name)
    thesis = tmp_path / "thesis"
    thesis.mkdir()
    (thesis / "thesis.txt").write_text("four years of work")
    for target in (run, thesis):
        before = _listing(target)
        rc = cli.main(["merge-lora", "--ckpt_dir", ckpt, "--output_dir", str(target),
                       "--exist_ok", "true", "--verify", "false"])
        err = capsys.readouterr().err
        assert rc == 2 and "replaces only a folder it wrote itself" in err, err
        assert _listing(target) == before
    # An earlier merge's output is replaced when asked, unless a file of the user's is in it.
    merged = tmp_path / "m-merged"
    swiftlite.merge_lora(ckpt, str(merged), verify=False)
    swiftlite.merge_lora(ckpt, str(merged), verify=False, exist_ok=True)
    (merged / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="notes.txt"):
        swiftlite.merge_lora(ckpt, str(merged), verify=False, exist_ok=True)
    assert (merged / "notes.txt").read_text() == "mine"
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n or ".old-" in n]
