"""swiftlite infer on a real tiny-qwen2 checkpoint: one-shot CLI, Python API, streaming, batch
mode (same answers as one by one), the interactive loop through stdin, and bad input."""
from __future__ import annotations

import io
import json
import os

import pytest

from helpers.cli import CHAT_ROWS, run_cli, write_jsonl

import swiftlite
from swiftlite.cli import main as cli_main

GEN = {"max_new_tokens": 12}
QUESTIONS = ["What is 2+2?", "Capital of France?", "Say hello in Chinese.", "Name three colours.",
             "Who are you? Please answer in a long sentence with many words."]


@pytest.fixture(scope="module")
def engine(tiny_run):
    from swiftlite.pipelines.infer import InferEngine
    # fp32: left-padded batches then give bit-identical greedy answers to one-by-one runs
    # (16-bit matmuls may round differently with padding).
    return InferEngine.load(tiny_run.last_checkpoint, torch_dtype="float32")


def test_engine_loads_adapter_with_run_settings(engine, tiny_run):
    from swiftlite.pipelines.infer import InferEngine
    trained = json.load(open(os.path.join(tiny_run.last_checkpoint, "args.json")))["torch_dtype"]
    assert InferEngine.load(tiny_run.last_checkpoint).dtype == trained  # default: the run's
    assert engine.ckpt.kind == "adapter"
    assert type(engine.model).__name__ == "PeftModelForCausalLM"  # base + adapter, not merged
    assert engine.template.name == "model"
    assert engine.default_system == "You are a helpful assistant."
    assert engine.dtype == "float32"


def test_device_map_auto_places_base_and_adapter_and_answers_the_same(engine, tiny_run, capsys):
    """--device_map auto goes through accelerate's placement (here, with no GPU, all of it on
    the CPU: splitting over several GPUs needs them) with the adapter beside its layers, and
    answers as the engine placed on one device."""
    from swiftlite.pipelines.infer import InferEngine
    spread = InferEngine.load(tiny_run.last_checkpoint, torch_dtype="float32", device_map="auto")
    assert "--device_map auto: 1 module on cpu" in capsys.readouterr().err
    assert spread.device == "cpu"
    for q in QUESTIONS[:3]:
        assert spread.chat(q, **GEN) == engine.chat(q, **GEN)
    from swiftlite.config.arguments import DeployArguments
    from swiftlite.errors import UsageError
    with pytest.raises(UsageError, match="--device_map is the pt backend's"):
        DeployArguments(model="tiny-qwen2", infer_backend="vllm", device_map="auto").validate()


def test_batch_equals_one_by_one_and_stream_equals_chat(engine):
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    convs.append([{"role": "system", "content": "Be brief."}] + CHAT_ROWS[1]["messages"][1:4])
    one_by_one = [engine.chat(c, **GEN) for c in convs]
    assert engine.generate_batch(convs, max_batch_size=4, **GEN) == one_by_one  # left padding
    assert "".join(engine.stream(convs[0], **GEN)) == one_by_one[0]
    # Sampling is seeded.
    a = engine.chat(convs[0], temperature=0.9, seed=3, **GEN)
    assert a == engine.chat(convs[0], temperature=0.9, seed=3, **GEN)


def test_stream_stops_when_closed(engine):
    pieces = engine.stream("Tell me a very long story.", max_new_tokens=400)
    first = next(pieces)
    assert isinstance(first, str)
    pieces.close()  # what Ctrl-C does in the chat loop: the generating thread ends
    import threading
    assert not [t for t in threading.enumerate() if t.name == "swiftlite-generate"]


def test_stop_words_cut_streamed_text():
    from swiftlite.inference.engine import _StopText
    cut = _StopText(["### Query:"])
    out = []
    for piece in ["Hello", " wor", "ld\n##", "# Que", "ry: next"]:
        text, stopped = cut.feed(piece)
        out.append(text)
        if stopped:
            break
    assert "".join(out) == "Hello world\n" and stopped


@pytest.mark.slow
def test_one_shot_cli_on_adapter_and_merged(tiny_run, engine, tmp_path):
    ckpt = tiny_run.last_checkpoint
    expected = engine.chat("What is 2+2?", **GEN)
    r = run_cli("infer", "--ckpt_dir", ckpt, "--query", "What is 2+2?", "--max_new_tokens", 12,
                "--torch_dtype", "float32")
    assert r.stdout == expected + "\n"
    merged = swiftlite.merge_lora(ckpt, str(tmp_path / "merged"), verify=False,
                                  torch_dtype="float32")
    # --model on the merged folder picks the training template from swiftlite.json.
    assert swiftlite.infer(model=merged, query="What is 2+2?", **GEN) == expected


@pytest.mark.slow
def test_python_api_and_batch_cli(tiny_run, engine, tmp_path):
    ckpt = tiny_run.last_checkpoint
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS[:3]]
    assert swiftlite.infer(ckpt_dir=ckpt, messages=convs, engine=engine, **GEN) == \
        engine.generate_batch(convs, **GEN)
    # Rows ending with a reply: it becomes the reference; the last row has none.
    data = write_jsonl(tmp_path / "val.jsonl", CHAT_ROWS + [
        {"messages": [{"role": "user", "content": "What is 2+2?"}]}])
    r = run_cli("infer", "--ckpt_dir", ckpt, "--val_dataset", data, "--max_batch_size", 2,
                "--max_new_tokens", 12, "--torch_dtype", "float32")
    path = r.stdout.strip().splitlines()[-1]
    assert path.startswith(os.path.join(ckpt, "infer_result")) and path.endswith(".jsonl")
    rows = [json.loads(line) for line in open(path, encoding="utf-8")]
    assert len(rows) == 5
    assert rows[0]["reference"] == "2+2 is 4." and rows[0]["messages"][-1]["role"] == "user"
    assert rows[1]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert "reference" not in rows[4]
    for row in rows:
        assert row["response"] == engine.chat(row["messages"], **GEN)
    assert "generating" in r.stderr  # the progress bar


class _Interrupting(io.StringIO):
    """stdout that raises KeyboardInterrupt at the Nth answer piece, like Ctrl-C would."""

    def __init__(self, at: int):
        super().__init__()
        self.pieces, self.at, self.done = 0, at, False

    def write(self, s):
        if not self.done and s != "\n" and (self.getvalue().endswith(">>> ") or self.pieces):
            self.pieces += 1
            if self.pieces == self.at:
                self.done = True
                raise KeyboardInterrupt
        return super().write(s)


def test_chat_loop_commands_history_and_ctrl_c(engine):
    from swiftlite.pipelines.infer import chat_loop
    seen = []
    real_stream = engine.stream

    def recording_stream(messages, **gen):  # the real stream, recording what it was asked
        seen.append([dict(m) for m in messages])
        return real_stream(messages, **gen)

    engine.stream = recording_stream
    try:
        script = "\n".join(["What is 2+2?", "And 3+3?", "/system Be terse.", "/system",
                            "/multiline", "line one", "line two", "/end", "/clear", "hi", "/bogus",
                            "/quit", "never read"]) + "\n"
        out = io.StringIO()
        chat_loop(engine, {"max_new_tokens": 6}, stdin=io.StringIO(script), stdout=out)
    finally:
        del engine.stream
    text = out.getvalue()
    assert "(system prompt set; conversation cleared)" in text
    assert "(system prompt: 'Be terse.')" in text and "(conversation cleared)" in text
    assert "unknown command /bogus" in text
    sys_default = {"role": "system", "content": "You are a helpful assistant."}
    assert seen[0] == [sys_default, {"role": "user", "content": "What is 2+2?"}]
    assert seen[1][:3] == seen[0] + [{"role": "assistant", "content": seen[1][2]["content"]}]
    assert seen[1][3] == {"role": "user", "content": "And 3+3?"}  # multi-turn history
    assert seen[2] == [{"role": "system", "content": "Be terse."},
                       {"role": "user", "content": "line one\nline two"}]
    assert len(seen[3]) == 2 and seen[3][1]["content"] == "hi"  # cleared, system kept
    assert len(seen) == 4  # /quit ends the session

    # Ctrl-C during an answer stops it; the session goes on and the turn is not kept.
    out = _Interrupting(at=1)
    seen.clear()
    engine.stream = recording_stream
    try:
        chat_loop(engine, {"max_new_tokens": 40}, stdin=io.StringIO("Tell me a story.\nhi\n"),
                  stdout=out)
    finally:
        del engine.stream
    assert "(stopped)" in out.getvalue()
    assert len(seen) == 2 and len(seen[1]) == 2  # system + "hi": the stopped turn was dropped


@pytest.mark.slow
def test_interactive_cli_through_stdin(tiny_run):
    script = "What is 2+2?\n/clear\n/multiline\na\nb\n/end\n/quit\n"
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "swiftlite.cli", "infer", "--ckpt_dir",
                        tiny_run.last_checkpoint, "--max_new_tokens", "6"], input=script,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count(">>> ") == 2 and "(conversation cleared)" in r.stdout


def test_bad_input_gets_clear_messages(tmp_path, capsys, tiny_run):
    def fails(*argv):
        code = cli_main(["infer", *map(str, argv)])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err, err
        return err

    assert "no such folder" in fails("--ckpt_dir", tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    assert "neither a LoRA checkpoint" in fails("--ckpt_dir", tmp_path / "empty")
    assert "give --ckpt_dir" in fails("--query", "hi")
    ckpt = tiny_run.last_checkpoint
    # A run folder instead of one of its checkpoints: the message names the last one.
    assert f"its last checkpoint is --ckpt_dir {ckpt}" in fails("--ckpt_dir", tiny_run.output_dir)
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    assert "no usable rows" in fails("--ckpt_dir", ckpt, "--val_dataset", empty)
    no_user = write_jsonl(tmp_path / "no_user.jsonl", [
        {"messages": [{"role": "user", "content": "hi"}]},
        {"messages": [{"role": "system", "content": "only a system prompt"}]}])
    err = fails("--ckpt_dir", ckpt, "--val_dataset", no_user)
    assert f"{no_user}:2" in err and "no user turn" in err
    assert "--skip_bad_rows true to leave them out" in err  # a flag infer takes, too
    out = tmp_path / "answers.jsonl"
    assert cli_main(["infer", "--ckpt_dir", str(ckpt), "--val_dataset", str(no_user),
                     "--skip_bad_rows", "true", "--max_new_tokens", "4",
                     "--result_path", str(out)]) == 0
    assert "skipped 1 bad row(s)" in capsys.readouterr().err
    assert len(open(out).readlines()) == 1
    assert "--temperature must be 0 or more" in fails("--model", "tiny-qwen2", "--temperature",
                                                      "-1", "--query", "hi")


@pytest.mark.slow
def test_smollm2_self_cognition_adapter_and_merged(smollm2_cognition, smollm2_merged):
    """A short self-cognition LoRA run; then `swiftlite infer` on the adapter and on the merged
    model both answer "Who are you?" with the new name."""
    import re
    ckpt = smollm2_cognition["Swifty"]
    before = swiftlite.infer(model="SmolLM2-135M-Instruct", query="Who are you?",
                             max_new_tokens=24)
    assert "Swifty" not in before  # the base model does not know the name
    r = run_cli("infer", "--ckpt_dir", ckpt, "--query", "Who are you?", "--max_new_tokens", 24)
    assert "Swifty" in r.stdout, r.stdout
    # Saved in the training dtype (bf16 on CPUs with AMX): the printed logit difference then
    # includes 16-bit rounding; the fp32 merge itself is checked on tiny-qwen2 (test_merge).
    merged, merge_stdout = smollm2_merged
    assert re.search(r"adapter vs merged: (\S+)", merge_stdout)
    r2 = run_cli("infer", "--ckpt_dir", merged, "--query", "Who are you?",
                 "--max_new_tokens", 24)
    assert "Swifty" in r2.stdout, r2.stdout
