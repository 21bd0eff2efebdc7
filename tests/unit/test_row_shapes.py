"""Row shapes other tools write, read as their authors meant (found by an audit, each seen
failing first): CSV rows with more cells than the header, CSV line numbers, OpenAI's per-message
`weight`, a top-level `system` beside `messages`, prompt-only files for `infer`, `#` inside a
path, and flags given twice or with a negative exponent."""
import json

import pytest

from swiftlite.config.argv import parse_argv
from swiftlite.config.sft_args import SftArguments
from swiftlite.data import load_conversations, parse_spec
from swiftlite.errors import UsageError

from helpers.cli import write_jsonl


def test_a_csv_row_with_more_cells_than_the_header_is_a_bad_row_at_its_line(tmp_path):
    """An unquoted comma in a reply made a third cell, which csv.DictReader files under the key
    None: the reply was cut at the comma and trained, and nothing was reported."""
    path = tmp_path / "d.csv"
    path.write_text("instruction,output\nWhat is 2+2?,\"It is 4, of course.\"\n"
                    "What is 3+3?,It is 6, of course.\n")
    with pytest.raises(UsageError) as e:
        load_conversations([str(path)])
    assert f"{path}:3:" in str(e.value) and "3 cells" in str(e.value)
    assert "quote" in str(e.value)
    convs, report = load_conversations([str(path)], skip_bad_rows=True)
    assert [c["messages"][-1]["content"] for c in convs] == ["It is 4, of course."]
    assert report.skipped == {"extra CSV cells": 1}
    # (was a TypeError from sorting the key None with the column names)
    (tmp_path / "u.csv").write_text("prompt,answer,x\na,b,c,d\n")
    with pytest.raises(UsageError, match="u.csv:2: 4 cells, the header has 3"):
        load_conversations([str(tmp_path / "u.csv")])


def test_csv_rows_are_named_by_the_line_they_start_on(tmp_path):
    """A cell spanning lines and a blank line moved every later row's file:line."""
    path = tmp_path / "d.csv"
    path.write_text('instruction,output\n"hi\nthere",ok\n\nq2,\n"q3",ok\n')  # q2: no reply
    convs, _ = load_conversations([str(path)], skip_bad_rows=True)
    assert [c["where"] for c in convs] == [f"{path}:2", f"{path}:6"]
    with pytest.raises(UsageError, match=f"{path}:5: message 1 .assistant. is empty"):
        load_conversations([str(path)])


def test_openai_weight_zero_is_not_trained(tmp_path):
    """OpenAI's fine-tuning format marks a reply not to learn with "weight": 0."""
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "BAD ANSWER", "weight": 0},
            {"role": "user", "content": "again"},
            {"role": "assistant", "content": "good", "weight": 1}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": msgs}])
    [conv], _ = load_conversations([path])
    assert [m.get("loss") for m in conv["messages"]] == [None, False, None, True]
    for bad, words in (({"weight": 0.5}, "0 or 1"), ({"weight": 1, "loss": False}, "disagree")):
        row = {"messages": [msgs[0], {**msgs[1], **bad}]}
        with pytest.raises(UsageError, match=words):
            load_conversations([write_jsonl(tmp_path / "b.jsonl", [row])])
    row = {"messages": [{**msgs[0], "weight": 0}, msgs[1]]}
    with pytest.raises(UsageError, match="only for assistant"):
        load_conversations([write_jsonl(tmp_path / "c.jsonl", [row])])


def test_a_top_level_system_beside_messages_comes_first(tmp_path):
    """Honoured for the other formats, it was dropped for `messages` rows."""
    chat = [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "Bob"}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"system": "You are Bob.", "messages": chat}])
    [conv], _ = load_conversations([path])
    assert conv["messages"] == [{"role": "system", "content": "You are Bob."}, *chat]
    both = {"system": "You are Bob.",
            "messages": [{"role": "system", "content": "You are Al."}, *chat]}
    with pytest.raises(UsageError, match="two system prompts"):
        load_conversations([write_jsonl(tmp_path / "b.jsonl", [both])])


@pytest.mark.parametrize("row,prompt", [
    ({"query": "What is 2+2?"}, "What is 2+2?"),
    ({"instruction": "Translate", "input": "hola"}, "Translate\nhola"),
])
def test_prompt_only_files_are_read_for_infer(tmp_path, row, prompt):
    """`infer --val_dataset` reads prompts; detection asked for the reply column as well."""
    path = write_jsonl(tmp_path / "d.jsonl", [row, row])
    convs, _ = load_conversations([path], require_reply=False)
    assert [c["messages"] for c in convs] == [[{"role": "user", "content": prompt}]] * 2
    with pytest.raises(UsageError, match="unknown dataset format"):
        load_conversations([path])  # training still needs the replies


def test_a_hash_inside_a_path_is_part_of_the_path(tmp_path):
    (tmp_path / "exp#2").mkdir()
    rows = [{"query": "q", "response": "r"}] * 3
    for name in ("exp#2/d.jsonl", "data#v2.jsonl"):
        path = write_jsonl(tmp_path / name, rows)
        assert parse_spec(path) == (path, None)
        assert len(load_conversations([path])[0]) == 3
        assert parse_spec(f"{path}#2") == (path, 2)
    with pytest.raises(UsageError) as e:
        load_conversations([str(tmp_path / "d.jsonl#x")])
    assert "no such file" in str(e.value) and "rows to sample" in str(e.value)
    with pytest.raises(UsageError, match="positive number"):
        parse_spec(f"{path}#0")


def test_a_list_flag_given_twice_keeps_every_value():
    args = parse_argv(SftArguments, ["--model", "m", "--dataset", "a.jsonl", "--dataset",
                                     "b.jsonl", "c.jsonl"], "sft", "")
    assert args.dataset == ["a.jsonl", "b.jsonl", "c.jsonl"]


def test_a_negative_number_in_exponent_form_is_a_value(tmp_path):
    args = parse_argv(SftArguments, ["--model", "m", "--dataset", "d", "--learning_rate",
                                     "-1e-4", "--weight_decay", "-2E-3"], "sft", "")
    assert (args.learning_rate, args.weight_decay) == (-1e-4, -2e-3)
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"model": "m", "dataset": ["d"]}))
    assert parse_argv(SftArguments, [str(config), "--weight_decay", "-1e-1"], "sft",
                      "").weight_decay == -0.1


def test_parquet_struct_columns_add_no_null_keys(tmp_path):
    """Parquet stores rows of one column as one struct type, the union of every row's keys:
    read back, a row's tool call had every other row's argument names as null, and trained
    them ({"city": "Paris", "tz": null})."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def row(name, args, result):
        call = {"type": "function", "function": {"name": name, "arguments": args}}
        return {"messages": [{"role": "user", "content": name},
                             {"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "content": result},
                             {"role": "assistant", "content": result}]}
    pq.write_table(pa.Table.from_pylist([row("get_weather", {"city": "Paris"}, "20C"),
                                         row("get_time", {"tz": "Asia/Tokyo"}, "9am")]),
                   tmp_path / "d.parquet")
    convs, _ = load_conversations([str(tmp_path / "d.parquet")])
    args = [c["messages"][1]["tool_calls"][0]["function"]["arguments"] for c in convs]
    args = [json.loads(a) if isinstance(a, str) else a for a in args]
    assert args == [{"city": "Paris"}, {"tz": "Asia/Tokyo"}]
