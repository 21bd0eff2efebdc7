"""Tool-calling SFT end to end on tiny-qwen2.5 (the official Qwen2.5-Instruct template), and
checkpoints and merged models that keep the model's own chat template byte for byte."""
import json

import pytest
from transformers import AutoTokenizer

from helpers.cli import run_cli, write_jsonl
from helpers.server import start_server, stop_server
from helpers.marks import VLLM_ONE_PROCESS_ENV, VLLM_ONE_PROCESS_FLAGS, VLLM_PYTHON, needs_vllm

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CITIES = ["Paris", "Rome", "Berlin", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi"]


def tool_rows():
    return [{"tools": [WEATHER], "messages": [
        {"role": "user", "content": f"What is the weather in {c}?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": c}}}]}]}
        for c in CITIES]


@pytest.fixture(scope="module")
def tiny_qwen25():
    from swiftlite.models.builtin import build
    return build("tiny-qwen2.5")


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory, tiny_qwen25):
    """tiny-qwen2.5, fully fine-tuned until it calls get_weather: (run folder, tools.json).
    lr 5e-3: at 1e-2 the loss spikes near step 25 and where it lands after 100 steps (0.23 or
    0.32, garbled JSON) swung with rounding-level changes; at 5e-3 four runs (seeds, code
    versions) ended at 0.17-0.19, each calling get_weather."""
    tmp_path = tmp_path_factory.mktemp("tool_run")
    data = write_jsonl(tmp_path / "tools.jsonl", tool_rows())
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER]))
    run_cli("sft", "--model", "tiny-qwen2.5", "--train_type", "full", "--dataset", data + "#64",
            "--max_steps", "100", "--per_device_train_batch_size", "8",
            "--gradient_accumulation_steps", "1", "--learning_rate", "5e-3",
            "--save_steps", "100", "--torch_dtype", "float32", "--report_to", "none",
            "--output_dir", tmp_path / "out")
    (run,) = (tmp_path / "out").iterdir()
    return run, tools


@pytest.fixture(scope="module")
def infer_reply(tool_run):
    """What `swiftlite infer` answers the trained checkpoint (one run, for both servers)."""
    run, tools = tool_run
    r = run_cli("infer", "--ckpt_dir", run / "checkpoint-100", "--query",
                "What is the weather in Madrid?", "--tools", tools, "--max_new_tokens", "40")
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_sft_teaches_a_tool_call_that_infer_parses(tool_run, tiny_qwen25, infer_reply):
    run, tools = tool_run
    ckpt = run / "checkpoint-100"
    own = AutoTokenizer.from_pretrained(tiny_qwen25).chat_template
    assert AutoTokenizer.from_pretrained(ckpt).chat_template == own
    args = json.loads((run / "args.json").read_text())
    assert args["template"] == "model" and args["loss_scale"] == "default"
    (call,) = infer_reply["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city"}
    # The same checkpoint behind swiftlite deploy answers with OpenAI tool_calls.
    proc, port, _ = start_server("--ckpt_dir", ckpt)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        kw = dict(model="checkpoint-100", temperature=0, max_tokens=40, tools=[WEATHER],
                  messages=[{"role": "user", "content": "What is the weather in Madrid?"}])
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls"
        (served,) = r.choices[0].message.tool_calls
        assert served.function.name == "get_weather"
        assert served.function.arguments == call["function"]["arguments"]  # same as infer
        chunks = list(client.chat.completions.create(stream=True, **kw))
        streamed = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
        assert [t.function.arguments for t in streamed] == [served.function.arguments]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    finally:
        stop_server(proc)


@pytest.mark.slow
@needs_vllm
def test_vllm_backend_returns_the_same_tool_call(tool_run, infer_reply):
    """--infer_backend vllm sets vLLM's hermes parser for Qwen2.5's template: the same call."""
    run, _ = tool_run
    ckpt = run / "checkpoint-100"
    (want,) = infer_reply["tool_calls"]
    proc, port, _ = start_server("--ckpt_dir", ckpt, "--infer_backend", "vllm", "--vllm_python",
                                 VLLM_PYTHON, *VLLM_ONE_PROCESS_FLAGS, env=VLLM_ONE_PROCESS_ENV,
                                 wait_s=300)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=120)
        r = client.chat.completions.create(
            model="checkpoint-100", temperature=0, max_tokens=40, tools=[WEATHER],
            messages=[{"role": "user", "content": "What is the weather in Madrid?"}])
        assert r.choices[0].finish_reason == "tool_calls"
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == want["function"]["name"]
        assert json.loads(call.function.arguments) == json.loads(want["function"]["arguments"])
    finally:
        stop_server(proc)


@pytest.mark.slow
def test_checkpoint_and_merged_model_keep_the_models_own_template(tmp_path, tiny_qwen25):
    import swiftlite
    data = write_jsonl(tmp_path / "tools.jsonl", tool_rows())
    own = AutoTokenizer.from_pretrained(tiny_qwen25).chat_template
    for system in (None, "You are Swifty."):
        run = swiftlite.sft(model="tiny-qwen2.5", dataset=[data], max_steps=1, save_steps=1,
                            system=system, report_to="none", output_dir=str(tmp_path / "o"))
        merged = swiftlite.merge_lora(ckpt_dir=run.last_checkpoint, verify=False)
        for folder in (run.last_checkpoint, merged):
            tok = AutoTokenizer.from_pretrained(folder)
            if system is None:
                assert tok.chat_template == own  # byte for byte
            else:  # the saved template renders what was trained: the --system prompt
                text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
                assert text.startswith("<|im_start|>system\nYou are Swifty.<|im_end|>")
                assert tok.chat_template.endswith(own)


@pytest.mark.slow
def test_eval_scores_the_tool_calls_of_the_trained_checkpoint(tool_run, tmp_path):
    """swiftlite eval on unseen cities: tool-call accuracy is the share of rows whose parsed
    call equals the reference's name and JSON arguments, as read back from predictions.jsonl."""
    run, _ = tool_run
    rows = [{"tools": [WEATHER], "messages": [
        {"role": "user", "content": f"What is the weather in {c}?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "get_weather", "arguments": {"city": c}}}]}]} for c in ("Madrid", "Quito",
                                                                             "Paris", "Rome")]
    data = write_jsonl(tmp_path / "calls.jsonl", rows)
    run_cli("eval", "--ckpt_dir", run / "checkpoint-100", "--eval_dataset", data,
            "--max_new_tokens", "40", "--eval_loss", "false", "--output_dir", tmp_path / "out")
    m = json.loads((tmp_path / "out" / "metrics.json").read_text())["overall"]
    preds = [json.loads(x) for x in open(tmp_path / "out" / "predictions.jsonl")]
    # Read back from the raw answers, independently of swiftlite's parser.
    import re
    names, right = [], []
    for p, r in zip(preds, rows):
        calls = []
        for block in re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", p["response"], re.S):
            try:
                calls.append(json.loads(block))
            except json.JSONDecodeError:
                calls.append(None)
        city = r["messages"][0]["content"].split(" in ")[1].rstrip("?")
        names.append([c and c.get("name") for c in calls] == ["get_weather"])
        right.append(calls == [{"name": "get_weather", "arguments": {"city": city}}])
    assert m["tool_call_name_accuracy"] == sum(names) / len(rows)
    assert m["tool_call_accuracy"] == sum(right) / len(rows)
    assert sum(names) >= 2  # the format is learned (the city is not always: a 100-step model)
    assert m["stopped"] == sum(p["finish_reason"] == "stop" for p in preds) / len(rows)
    assert "rougeL" not in m  # a reply that only calls tools has no text to score
