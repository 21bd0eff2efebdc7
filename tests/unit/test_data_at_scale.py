"""--streaming (rows read and tokenised as training consumes them) and --packing (samples
packed into rows of up to max_length), on tiny-qwen2 in this process."""
import json
import os
import random

import pytest

from helpers.cli import write_jsonl

from swiftlite.errors import UsageError

ROWS = 2_000_000


@pytest.fixture(scope="module")
def millions(tmp_path_factory) -> str:
    """A .jsonl of 2M short chat rows (214 MB): far more than a test could tokenise upfront."""
    path = tmp_path_factory.mktemp("stream") / "millions.jsonl"
    with open(path, "w") as f:
        f.write("".join(f'{{"messages": [{{"role": "user", "content": "q{i}"}}, {{"role": '
                        f'"assistant", "content": "answer {i}"}}]}}\n' for i in range(ROWS)))
    return str(path)


def _losses(run_dir: str) -> dict[int, float]:
    with open(os.path.join(run_dir, "logging.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


@pytest.mark.slow
def test_streaming_trains_at_once_on_millions_of_rows_and_resumes_in_place(millions, tmp_path,
                                                                         tiny_qwen2, capsys):
    """Only what training consumes is read (the shuffle buffer and the batches), not the 2M
    rows; a run resumed from its checkpoint at step 2 trains steps 3 and 4 on the same
    batches as the uninterrupted run (identical losses)."""
    import swiftlite
    common = dict(model="tiny-qwen2", dataset=[millions], streaming=True, max_steps=4,
                  save_steps=2, logging_steps=1, report_to="none", shuffle_buffer_size=500)
    whole = swiftlite.sft(**common, output_dir=str(tmp_path / "whole"))
    log = capsys.readouterr().err
    assert "nothing read upfront" in log and "first sample:" in log and "Tokenising" not in log
    read = whole.metrics["dataset_stream"]["rows"]
    assert 4 * 16 < read < 2000, read  # 4 steps of 16 samples, the buffer, a tokenizer batch
    args = json.load(open(os.path.join(whole.output_dir, "args.json")))
    assert args["dataset_report"] == {"streaming": True, "shuffle_buffer_size": 500}

    resumed = swiftlite.sft(**common, output_dir=str(tmp_path / "resumed"),
                            resume_from_checkpoint=os.path.join(whole.output_dir, "checkpoint-2"))
    a, b = _losses(whole.output_dir), _losses(resumed.output_dir)
    assert sorted(b) == [3, 4] and len(set(a.values())) == 4
    assert b == {3: a[3], 4: a[4]}


@pytest.mark.slow
def test_streaming_passes_over_small_data_again_and_names_a_bad_row(tmp_path, tiny_qwen2,
                                                                  capsys):
    import swiftlite
    from helpers.cli import CHAT_ROWS
    data = write_jsonl(tmp_path / "few.jsonl", CHAT_ROWS + ["{not json"] + CHAT_ROWS)
    common = dict(model="tiny-qwen2", dataset=[data], streaming=True, max_steps=3,
                  report_to="none", output_dir=str(tmp_path / "out"))
    with pytest.raises(UsageError, match=r"few.jsonl:5: invalid JSON.*--skip_bad_rows true"):
        swiftlite.sft(**common)
    done = swiftlite.sft(**common, skip_bad_rows=True)  # steps of 16 samples from 8 rows
    stream = done.metrics["dataset_stream"]
    assert stream["passes"] > 1 and stream["rows"] == 9 * stream["passes"]
    assert stream["skipped"] == {"invalid JSON": stream["passes"]}
    assert "stream: " in capsys.readouterr().err


@pytest.mark.parametrize("given, words", [
    (dict(max_steps=-1), "--streaming true needs --max_steps"),
    (dict(split_dataset_ratio=0.1), "give --val_dataset FILE instead"),
    (dict(packing=True), "--packing with --streaming true"),
    (dict(shuffle_buffer_size=0), "--shuffle_buffer_size must be at least 1"),
])
def test_streaming_usage_errors(given, words):
    from swiftlite.config.arguments import SftArguments
    args = SftArguments(model="tiny-qwen2", dataset=["d.jsonl"], **{
        "streaming": True, "max_steps": 5, **given})
    with pytest.raises(UsageError, match=words):
        args.validate()


def test_streaming_refuses_sampling_before_reading():
    from swiftlite.data.stream import check_specs
    with pytest.raises(UsageError, match=r"d.jsonl#5 with --streaming true: #N sampling"):
        check_specs(["d.jsonl#5"])


def test_packing_refuses_padded_batches():
    from swiftlite.config.arguments import SftArguments
    with pytest.raises(UsageError, match="drop --padding_free false"):
        SftArguments(model="m", dataset=["d"], packing=True, padding_free=False).validate()


def test_best_fit_packing_puts_every_sample_once_within_max_length():
    from swiftlite.data.packing import pack
    rng = random.Random(0)
    lengths = [rng.randint(1, 512) for _ in range(20_000)] + [600]  # one longer than a row
    rows = pack(lengths, 512)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 512 for row in rows if len(row) > 1)
    assert sum(lengths) / (len(rows) * 512) > 0.97  # near-full rows
    assert pack([300, 200, 200, 100, 12], 512) == [[0, 1, 4], [2, 3]]  # best fit: 12 -> row 0


@pytest.mark.slow
def test_packed_training_has_the_per_token_loss_of_unpacked_training(tmp_path, tiny_qwen2,
                                                                    capsys):
    """One batch of the whole data per step, no dropout, fp32: two steps of packed rows give
    the losses of the same samples unpacked (attention stays inside each sample, no token is
    trained on the next sample's first), and the gradients too (step 2 after an update)."""
    import swiftlite
    rng = random.Random(1)
    rows = [{"messages": [
        {"role": "user", "content": " ".join(str(rng.randint(0, 99)) for _ in range(
            rng.randint(1, 30)))},
        {"role": "assistant", "content": " ".join(str(rng.randint(0, 99)) for _ in range(
            rng.randint(1, 40)))}]} for _ in range(24)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    common = dict(model="tiny-qwen2", dataset=[data], max_steps=2, logging_steps=1,
                  report_to="none", max_length=256, per_device_train_batch_size=64,
                  gradient_accumulation_steps=1, lora_dropout=0.0, torch_dtype="float32",
                  learning_rate=5e-3, warmup_ratio=0.0)
    plain = swiftlite.sft(**common, output_dir=str(tmp_path / "plain"))
    packed = swiftlite.sft(**common, packing=True, output_dir=str(tmp_path / "packed"))
    log = capsys.readouterr().err
    assert "packing: 24 samples into" in log and "efficiency" in log
    stats = json.load(open(os.path.join(packed.output_dir, "args.json")))["dataset_report"][
        "packing"]
    assert stats["rows"] < 24 and 0.5 < stats["efficiency"] <= 1
    a, b = _losses(plain.output_dir), _losses(packed.output_dir)
    assert a[1] != a[2]
    for step in (1, 2):
        assert b[step] == pytest.approx(a[step], rel=1e-5), (a, b)


def test_a_large_jsonl_is_checked_in_parts_exactly_as_in_one_pass(tmp_path, monkeypatch):
    """Checking a .jsonl in 3 processes, each reading its part of the file, finds the same
    rows at the same places and names the same bad rows (file:line, in the file's order) as
    one process: parts split at line beginnings, blank lines and bad rows on either side of
    a cut."""
    from swiftlite.data import loader
    lines = []
    for i in range(300):
        lines.append(json.dumps({"messages": [{"role": "user", "content": f"q{i}" * (i % 7)},
                                              {"role": "assistant", "content": f"a{i}"}]}))
        if i % 41 == 0:
            lines.append("")
        if i % 53 == 5:
            lines.append("{broken" if i % 2 else json.dumps({"messages": []}))
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")

    def load(num_proc: int):
        loaded = loader.load_datasets([str(path)], skip_bad_rows=True, num_proc=num_proc)
        with pytest.raises(UsageError) as e:
            loader.load_datasets([str(path)], num_proc=num_proc)
        return loaded, str(e.value)

    monkeypatch.setattr(loader, "PARALLEL_CHECK_BYTES", 1)
    from swiftlite.data import files
    assert len(files.file_parts(str(path), 3)) == 3
    (parallel, parallel_error), (one, one_error) = load(3), load(1)
    assert parallel.train._items == one.train._items and len(one.train) == 300
    assert parallel.report == one.report and sum(one.report.skipped.values()) == 6
    assert parallel_error == one_error and f"{path}:8: invalid JSON" in one_error  # the first bad row
    assert list(parallel.train)[123] == list(one.train)[123]
