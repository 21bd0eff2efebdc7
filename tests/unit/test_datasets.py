"""Dataset formats, validation of bad rows, sampling, built-ins, encoding and its cache."""
import csv
import json

import pytest

from swiftlite.data import load_conversations, parse_spec
from swiftlite.data.encode import encode_dataset
from swiftlite.errors import UsageError
from swiftlite.data.template import get_template

from helpers.cli import write_jsonl

EXPECTED = [{"role": "system", "content": "Be nice."},
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]

ROWS = {
    "messages": {"messages": EXPECTED},
    "sharegpt": {"system": "Be nice.", "conversations": [
        {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"},
        {"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]},
    "alpaca": {"system": "Be nice.", "history": [["Hi", "Hello"]], "instruction": "Q",
               "input": "", "output": "A"},
    "query-response": {"system": "Be nice.", "history": [["Hi", "Hello"]], "query": "Q",
                       "response": "A"},
}


@pytest.mark.parametrize("fmt", list(ROWS))
def test_every_format_normalises_to_messages(tmp_path, fmt):
    path = write_jsonl(tmp_path / "d.jsonl", [ROWS[fmt]])
    convs, report = load_conversations([path])
    assert convs == [{"messages": EXPECTED, "where": f"{path}:1"}]
    assert report.kept == 1 and not report.skipped


def test_alpaca_input_joins_instruction(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "Translate", "input": "hola",
                                               "output": "hello"}])
    assert load_conversations([path])[0][0]["messages"][0] == {"role": "user", "content": "Translate\nhola"}


def test_json_csv_parquet(tmp_path):
    rows = [{"query": f"q{i}", "response": f"r{i}"} for i in range(3)]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    with open(tmp_path / "d.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["query", "response"])
        w.writeheader()
        w.writerows(rows)
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    for ext in ("json", "csv", "parquet"):
        convs, _ = load_conversations([str(tmp_path / f"d.{ext}")])
        assert [c["messages"][-1]["content"] for c in convs] == ["r0", "r1", "r2"], ext


BAD = [
    ('{"messages": [{"role": "user", "content": "a"}', "invalid JSON"),
    ({"messages": [{"role": "assistant", "content": "b"}, {"role": "user", "content": "a"}]},
     "wrong role order"),
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "b"}]}, "has no content"),
    ({"messages": [{"role": "user", "content": ["x"]}, {"role": "assistant", "content": "b"}]},
     "must be a string, got list"),
    ({"text": "plain"}, "unknown format"),
    ({"messages": [{"role": "user", "content": "a"}]}, "does not end with an assistant reply"),
    ({"messages": [{"role": "robot", "content": "a"}, {"role": "assistant", "content": "b"}]},
     "unknown role"),
]


@pytest.mark.parametrize("bad,reason", BAD)
def test_bad_row_names_file_line_and_reason(tmp_path, bad, reason):
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [good, good, bad])
    with pytest.raises(UsageError) as e:
        load_conversations([path])
    assert f"{path}:3:" in str(e.value) and reason in str(e.value)
    assert "--skip_bad_rows" in str(e.value)


def test_skip_bad_rows_counts_each_reason(tmp_path):
    good = {"query": "a", "response": "b"}
    path = write_jsonl(tmp_path / "d.jsonl", [good, "{oops", {"query": "a"}, {"query": "a"}, good])
    convs, report = load_conversations([path], skip_bad_rows=True)
    assert len(convs) == 2
    assert report.rows == 5 and report.kept == 2
    assert report.skipped == {"invalid JSON": 1, "missing content": 2}


def test_empty_dataset_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["{oops"])
    with pytest.raises(UsageError, match="no usable rows"):
        load_conversations([path], skip_bad_rows=True)


def test_missing_file_and_bad_extension(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        load_conversations([str(tmp_path / "nope.jsonl")])
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(UsageError, match="unsupported file type .txt"):
        load_conversations([str(tmp_path / "d.txt")])


def test_sampling_syntax_is_seeded_and_repeats(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"query": f"q{i}", "response": "r"} for i in range(10)])
    assert parse_spec(f"{path}#4") == (path, 4)
    a, _ = load_conversations([f"{path}#4"], seed=1)
    b, _ = load_conversations([f"{path}#4"], seed=1)
    c, _ = load_conversations([f"{path}#4"], seed=2)
    assert a == b and len(a) == 4 and a != c
    big, _ = load_conversations([f"{path}#25"])
    assert len(big) == 25
    with pytest.raises(UsageError, match="positive number"):
        parse_spec(f"{path}#0")


def test_self_cognition_fills_name_and_author():
    convs, _ = load_conversations(["self-cognition#200"], model_name=["Swifty", "小燕"],
                                  model_author=["Acme", "阿克米"])
    text = json.dumps(convs, ensure_ascii=False)
    assert "{{" not in text and "Swifty" in text and "Acme" in text and "小燕" in text
    assert len(convs) == 200


def test_encoding_truncation_counts_and_cache(tmp_path, tiny_qwen2, monkeypatch, capsys):
    import datasets
    monkeypatch.setenv("SWIFTLITE_CACHE", str(tmp_path / "cache"))
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    convs = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * n}]
             for n in (1, 5, 80)]
    t = get_template("qwen", tok)
    ds, rep = encode_dataset(convs, t, max_length=40, truncation_strategy="delete")
    assert len(ds) == 2 and sum(rep.dropped.values()) == 1 and rep.truncated == 0
    ds, rep = encode_dataset(convs, t, max_length=40, truncation_strategy="right")
    assert len(ds) == 3 and rep.truncated == 1 and max(ds["length"]) == 40
    # Writing the cache shows no "Saving the dataset" bar of its own, and leaves datasets'
    # bars as they were.
    assert "Saving the dataset" not in capsys.readouterr().err
    assert datasets.is_progress_bar_enabled()
    ds2, rep2 = encode_dataset(convs, t, max_length=40, truncation_strategy="right")
    assert rep2.from_cache and rep2.cache_path == rep.cache_path
    assert ds2["input_ids"] == ds["input_ids"]
    # A different system prompt (template) must not reuse the cached tokens.
    _, rep3 = encode_dataset(convs, get_template("qwen", tok, system="Other."), max_length=40,
                             truncation_strategy="right")
    assert not rep3.from_cache and rep3.cache_path != rep.cache_path


def test_nothing_left_is_not_cached_and_a_damaged_cache_is_rebuilt(tmp_path, tiny_qwen2,
                                                                    monkeypatch):
    import os
    import shutil
    monkeypatch.setenv("SWIFTLITE_CACHE", str(tmp_path / "cache"))
    from transformers import AutoTokenizer
    t = get_template("qwen", AutoTokenizer.from_pretrained(tiny_qwen2))
    convs = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]]
    ds, rep = encode_dataset(convs, t, max_length=2)
    assert len(ds) == 0 and not os.path.exists(rep.cache_path)
    ds, rep = encode_dataset(convs, t, max_length=64)
    shutil.rmtree(os.path.join(rep.cache_path))  # leave only a report behind: unreadable
    os.makedirs(rep.cache_path)
    with open(os.path.join(rep.cache_path, "swiftlite_report.json"), "w") as f:
        f.write("{}")
    ds2, rep2 = encode_dataset(convs, t, max_length=64)
    assert not rep2.from_cache and ds2["input_ids"] == ds["input_ids"]


# -- tool calling, reasoning and loss flags -------------------------------------------------
WEATHER_TOOL = {"name": "get_weather", "description": "Weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL_MESSAGES = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "18C"},
    {"role": "assistant", "content": "18°C."}]
TOOL_ROWS = {
    # OpenAI messages; tools as a JSON string of bare schemas, arguments as a JSON string
    "messages": {"tools": json.dumps([WEATHER_TOOL]), "messages": [
        CALL_MESSAGES[0],
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        CALL_MESSAGES[2], CALL_MESSAGES[3]]},
    # ms-swift: tool_call / tool_response roles
    "ms-swift": {"tools": [{"type": "function", "function": WEATHER_TOOL}], "messages": [
        CALL_MESSAGES[0],
        {"role": "tool_call", "content": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
        {"role": "tool_response", "content": "18C"}, CALL_MESSAGES[3]]},
    # LLaMA-Factory ShareGPT: function_call / observation speakers and a tools column
    "sharegpt": {"tools": json.dumps([WEATHER_TOOL]), "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
        {"from": "observation", "value": "18C"}, {"from": "gpt", "value": "18°C."}]},
}


@pytest.mark.parametrize("fmt", list(TOOL_ROWS))
def test_tool_rows_of_every_convention_normalise_to_openai_messages(tmp_path, fmt):
    path = write_jsonl(tmp_path / "d.jsonl", [TOOL_ROWS[fmt]])
    (conv,), _ = load_conversations([path])
    assert conv["tools"] == [{"type": "function", "function": WEATHER_TOOL}]
    got = [{k: v for k, v in m.items() if k != "id"} for m in conv["messages"]]
    for m in got:
        for c in m.get("tool_calls", []):
            c.pop("id", None)
    assert got == CALL_MESSAGES


def test_reasoning_and_loss_flags_are_kept(tmp_path):
    row = {"messages": [{"role": "user", "content": "2+2?"},
                        {"role": "assistant", "content": "4", "reasoning_content": "add",
                         "loss": False}]}
    (conv,), _ = load_conversations([write_jsonl(tmp_path / "d.jsonl", [row])])
    assert conv["messages"][1] == {"role": "assistant", "content": "4",
                                   "reasoning_content": "add", "loss": False}


TOOL_BAD = [
    ({"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "r"},
                   {"role": "assistant", "content": "b"}]},
     "tool message, but it does not follow an assistant turn with tool calls"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "{city: Paris}"}}]}]},
     "the arguments: not valid JSON"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"arguments": {}}}]}]}, "has no function name"),
    ({"tools": "[{oops", "messages": [{"role": "user", "content": "a"},
                                      {"role": "assistant", "content": "b"}]},
     "the tool list: not valid JSON"),
    ({"messages": [{"role": "user", "content": "a"},
                   {"role": "assistant", "content": "b", "loss": "no"}]}, "'loss' must be true or false"),
    ({"conversations": [{"from": "human", "value": "a"}, {"from": "wizard", "value": "b"}]},
     "unknown speaker 'wizard'"),
]


@pytest.mark.parametrize("bad,reason", TOOL_BAD)
def test_bad_tool_rows_name_file_line_and_reason(tmp_path, bad, reason):
    good = ({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}
            if "conversations" in bad else
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
    path = write_jsonl(tmp_path / "d.jsonl", [good, bad])
    with pytest.raises(UsageError) as e:
        load_conversations([path])
    assert f"{path}:2:" in str(e.value) and reason in str(e.value)


def test_rows_the_template_rejects_are_named_before_training(tmp_path, tiny_qwen2, monkeypatch):
    """A tool row for a model whose template has no tool syntax: file:line and the reason."""
    from transformers import AutoTokenizer
    monkeypatch.setenv("SWIFTLITE_CACHE", str(tmp_path / "cache"))
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [good, TOOL_ROWS["messages"]])
    convs, _ = load_conversations([path])
    template = get_template(None, AutoTokenizer.from_pretrained(tiny_qwen2))
    with pytest.raises(UsageError) as e:
        encode_dataset(convs, template, max_length=128)
    assert f"{path}:2:" in str(e.value) and "cannot render it: it has no place for tools" in str(e.value)
    assert "the the" not in str(e.value)
    ds, rep = encode_dataset(convs, template, max_length=128, skip_bad_rows=True)
    assert len(ds) == 1 and rep.dropped == {"rejected by the chat template": 1}
    # the lenient run's cache entry does not let a strict run pass over the same row
    with pytest.raises(UsageError, match=f"{path}:2:"):
        encode_dataset(convs, template, max_length=128)
    assert encode_dataset(convs, template, max_length=128, skip_bad_rows=True)[1].from_cache


def test_split_comes_before_sampling_so_no_validation_row_is_a_training_copy(tmp_path):
    from swiftlite.data import load_datasets
    rows = [{"query": f"q{i}", "response": f"r{i}"} for i in range(10)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    loaded = load_datasets([f"{path}#100"], split_ratio=0.2, seed=3)
    key = lambda c: c["messages"][0]["content"]  # noqa: E731
    train, val = {key(c) for c in loaded.train}, [key(c) for c in loaded.val]
    assert len(val) == 2 and len(set(val)) == 2 and not train & set(val)
    assert len(loaded.train) == 98 and len(train) == 8
    assert "98 samples + 2 for validation" in loaded.report.summary()
    plain = load_datasets([path], split_ratio=0.3, seed=3)
    assert len(plain.val) == 3 and len(plain.train) == 7


def test_parallel_tokenising_gives_the_same_samples_and_report(tiny_qwen2):
    """--dataset_num_proc 2 (forked workers, chunks written in order into the Arrow file)
    gives exactly what one process gives, truncations and drops included."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    # every 7th prompt is longer than max_length: cut on the right, nothing trained is left
    convs = [[{"role": "user", "content": f"Question {i}?" + " more" * (100 * (i % 7 == 0))},
              {"role": "assistant", "content": "word " * (i % 90)}] for i in range(2500)]
    t = get_template("qwen", tok)
    one, r1 = encode_dataset(convs, t, max_length=64, truncation_strategy="right",
                             use_cache=False, num_proc=1)
    two, r2 = encode_dataset(convs, t, max_length=64, truncation_strategy="right",
                             use_cache=False, num_proc=2)
    assert r1.truncated > 0 and sum(r1.dropped.values()) > 0  # both paths are exercised
    assert one["input_ids"] == two["input_ids"] and one["labels"] == two["labels"]
    assert r1.to_dict() == r2.to_dict()
    assert one.cache_files  # memory-mapped from its Arrow file, not held in RAM


@pytest.mark.slow
def test_a_warm_start_skips_reading_the_files_until_one_changes(tmp_path, monkeypatch, capsys,
                                                                tiny_qwen2):
    """The second run of the same files and settings loads the encoded data without reading
    a row (data.manifest); a changed file, or another template, reads and checks them again."""
    import swiftlite
    from helpers.cli import CHAT_ROWS
    monkeypatch.setenv("SWIFTLITE_CACHE", str(tmp_path / "cache"))
    data = write_jsonl(tmp_path / "d.jsonl", CHAT_ROWS * 3)

    def run(**kw):
        swiftlite.sft(model="tiny-qwen2", dataset=[data], max_steps=1, report_to="none",
                      output_dir=str(tmp_path / "out"), split_dataset_ratio=0.25, **kw)
        return capsys.readouterr().err

    first = run()
    assert "12 rows read" in first and "read before" not in first
    second = run()
    assert "12 rows read -> 9 samples + 3 for validation (these files were read before" in second
    assert "tokenised data loaded from the cache" in second and "Tokenising" not in second
    assert "read before" not in run(system="Other.")  # another template: read again
    with open(data, "a", encoding="utf-8") as f:  # the file changes: read and checked again
        f.write('{"messages": [{"role": "user", "content": "x"}]}\n')
    with pytest.raises(UsageError, match="d.jsonl:13"):
        run()


def test_jsonl_rows_stay_on_disk_until_tokenised(tmp_path, tiny_qwen2):
    """load_datasets keeps a .jsonl row as its place in the file (not its dicts); the rows it
    reads back, in forked tokenising workers too, are the ones checked, #N and split applied."""
    from transformers import AutoTokenizer

    from swiftlite.data.loader import load_datasets
    rows = [{"messages": [{"role": "user", "content": f"Q{i}: café?"},
                          {"role": "assistant", "content": f"A{i} " * (i % 30 + 1)}]}
            for i in range(2500)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    loaded = load_datasets([f"{path}#3000"], split_ratio=0.1)
    assert all(isinstance(item, tuple) for item in loaded.train._items)
    assert len(loaded.train) == 3000 - 250 and len(loaded.val) == 250  # 10% of the 2500 rows
    first = loaded.train[0]
    assert first["where"].startswith(f"{path}:") and first["messages"][0]["content"].startswith("Q")
    in_memory = list(loaded.train)
    t = get_template("qwen", AutoTokenizer.from_pretrained(tiny_qwen2))
    a, _ = encode_dataset(loaded.train, t, max_length=128, use_cache=False, num_proc=2)
    b, _ = encode_dataset(in_memory, t, max_length=128, use_cache=False, num_proc=1)
    assert a["input_ids"] == b["input_ids"] and a["labels"] == b["labels"]
