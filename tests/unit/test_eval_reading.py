"""`swiftlite eval` and `export` cases an audit found, each seen failing first: a thinking
template's empty think block in answers and before option letters, ROUGE that tokenised the
two sides of a pair differently or dropped non-Latin scripts, JSON types in tool arguments, two
sets of one name, CMMLU's column names, a bad --compare found after the first model's whole
evaluation, and gguf-lora's default type."""
import os

import pytest

from helpers.cli import write_jsonl


@pytest.fixture(scope="module")
def tiny_qwen3():
    from swiftlite.models.builtin import build
    return build("tiny-qwen3")


def _template(model_dir):
    from swiftlite.data.template import get_template
    from swiftlite.models.loader import load_tokenizer
    return get_template(None, load_tokenizer(model_dir))


def test_choice_letters_are_read_where_the_trained_reply_starts(tiny_qwen3, tiny_qwen2):
    """Qwen3's template opens every trained reply with an empty think block: the letter a
    fine-tuned model writes comes after it, not right after the assistant header."""
    from swiftlite.evaluation import choice
    item = {"question": "What is 2 + 2?", "options": {"A": "3", "B": "4"}, "answer": "B"}
    for model, opened in ((tiny_qwen3, True), (tiny_qwen2, False)):
        template = _template(model)
        conv = choice.conversation(item, [])
        prompt = choice.prompt_ids(template, conv)
        letter = template.tokenizer("B", add_special_tokens=False)["input_ids"]
        trained = template.encode(conv + [{"role": "assistant", "content": "B"}])["input_ids"]
        assert trained[:len(prompt) + len(letter)] == prompt + letter
        assert (len(prompt) > len(template.encode_prompt(conv))) == opened


def test_chat_answers_are_scored_without_the_think_block(tiny_qwen3):
    from swiftlite.config.eval_args import EvalArguments
    from swiftlite.inference.engine import Answer
    from swiftlite.pipelines.eval import score_chat

    class Engine:  # what score_chat reads of an InferEngine: its template's reply parser
        template = _template(tiny_qwen3)
        from swiftlite.inference.engine import InferEngine
        parse = InferEngine.parse

    convs = [{"messages": [{"role": "user", "content": "Capital of France?"},
                           {"role": "assistant", "content": "Paris."}]}]
    answer = Answer("<think>\n\n</think>\n\nParis.", "stop", 8)
    [row] = score_chat(Engine(), convs, [answer],
                       EvalArguments(model="m", eval_dataset=["d"], eval_loss=False))
    assert row["content"] == "Paris." and row["exact_match"] == 1.0
    assert row["bleu4"] == pytest.approx(100) and row["rougeL"] == 100


@pytest.mark.parametrize("hyp, ref", [("我是Swifty", "Swifty"), ("答案是B", "B"),
                                      ("GPU", "GPU显卡"), ("Hello 世界", "hello 世界")])
def test_rouge_tokenises_both_sides_of_a_pair_alike(hyp, ref):
    import jieba
    from rouge_score import rouge_scorer
    from swiftlite.evaluation.metrics import text_scores

    class Words:
        def tokenize(self, text):
            return [w.lower() for w in jieba.cut(text) if w.strip()]
    want = rouge_scorer.RougeScorer(["rouge1"], tokenizer=Words()).score(ref, hyp)
    [got] = text_scores([hyp], [ref])
    assert got["rouge1"] == pytest.approx(100 * want["rouge1"].fmeasure) and got["rouge1"] > 0


@pytest.mark.parametrize("text", ["안녕하세요 반갑습니다", "こんにちは", "Привет мир",
                                  "Καλημέρα κόσμε", "مرحبا بالعالم"])
def test_identical_answers_in_any_script_score_full_rouge(text):
    from swiftlite.evaluation.metrics import text_scores
    [row] = text_scores([text], [text])
    assert row["rouge1"] == row["rougeL"] == 100 and row["exact_match"] == 1.0


def test_tool_arguments_compare_json_types():
    from swiftlite.evaluation.metrics import tool_call_scores
    call = lambda args: [{"function": {"name": "f", "arguments": args}}]
    assert tool_call_scores(call('{"on": 1, "n": false}'), call('{"on": true, "n": 0}')) == {
        "tool_call_name": 1.0, "tool_call": 0.0}
    assert tool_call_scores(call('{"x": 1.0, "y": [true]}'), call({"y": [True], "x": 1}))[
        "tool_call"] == 1.0


def test_sets_of_one_file_name_are_kept_apart(tmp_path):
    from swiftlite.config.eval_args import EvalArguments
    from swiftlite.pipelines.eval import read_sets
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    for d in "ab":
        (tmp_path / d).mkdir()
    a = write_jsonl(tmp_path / "a" / "test.jsonl", rows)
    b = write_jsonl(tmp_path / "b" / "test.jsonl", rows * 2)
    sets = read_sets(EvalArguments(model="m", eval_dataset=[a, b]))
    assert [len(s["rows"]) for s in sets.values()] == [1, 2]
    assert len(set(sets)) == 2 and all(n.endswith("test.jsonl") for n in sets)


def test_cmmlu_columns_are_a_multiple_choice_set(tmp_path):
    from swiftlite.config.eval_args import EvalArguments
    from swiftlite.pipelines.eval import read_sets
    path = tmp_path / "cmmlu.csv"
    path.write_text(",Question,A,B,C,D,Answer\n0,1+1=?,1,2,3,4,B\n1,2+2=?,4,5,6,7,A\n")
    [s] = read_sets(EvalArguments(model="m", eval_dataset=[str(path)])).values()
    assert s["kind"] == "choice" and [r["answer"] for r in s["rows"]] == ["B", "A"]
    assert s["rows"][0]["question"] == "1+1=?"


def test_a_bad_compare_stops_before_any_model_loads(tmp_path, tiny_qwen2):
    import swiftlite
    from swiftlite.errors import UsageError
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}])
    for bad, words in (("tiny-qwen9", "--compare tiny-qwen9: no such folder"),
                       (str(tmp_path), "--compare")):
        with pytest.raises(UsageError, match=words):
            swiftlite.eval(model=tiny_qwen2, eval_dataset=[data], compare=bad,
                           output_dir=str(tmp_path / "out"))
        assert not os.path.exists(tmp_path / "out")


def test_gguf_lora_defaults_to_f16(tiny_run):
    from swiftlite.config.export_args import ExportArguments
    args = ExportArguments(ckpt_dir=tiny_run.last_checkpoint, format="gguf-lora").validate()
    assert args.quant == "f16"
    assert ExportArguments(model="tiny-qwen2").validate().quant == "q4_k_m"


def test_eval_generate_scores_replies_without_the_think_block(tiny_qwen3):
    """--eval_generate during training reads its references back from the training encoding,
    where a Qwen3 reply opens with the empty think block: scored as `swiftlite eval` scores."""
    from swiftlite.training.eval_generate import GenerationMetrics
    template = _template(tiny_qwen3)
    enc = template.encode([{"role": "user", "content": "Capital of France?"},
                           {"role": "assistant", "content": "Paris."}])
    assert "<think>" in template.tokenizer.decode(
        [i for i, y in zip(enc["input_ids"], enc["labels"]) if y != -100])
    tok = template.tokenizer
    tok.chat_template = template.to_jinja()  # as build_trainer saves it
    scorer = GenerationMetrics([enc], tok, max_new_tokens=4, batch=1)
    assert scorer.refs == ["Paris."]


def test_a_lora_export_over_a_folder_of_links_says_what_ollama_needs(tmp_path):
    """Hugging Face's cache links a snapshot's files to blobs; Ollama refuses such a FROM folder
    (its insecure-path check), so the printed steps say how to get a base it takes."""
    from swiftlite.export.gguf import how_to_run
    (tmp_path / "blob").write_text("{}")
    base = tmp_path / "snapshot"
    base.mkdir()
    (base / "config.json").symlink_to(tmp_path / "blob")
    text = how_to_run(str(tmp_path / "out"), "a.gguf", "a", True, str(base))
    assert "folder of links" in text and f"--model {base} --quant f16" in text
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    assert "folder of links" not in how_to_run(str(tmp_path / "out"), "a.gguf", "a", True,
                                               str(plain))


def test_rows_a_template_cannot_ask_stop_before_any_model_loads(tmp_path, tiny_qwen2,
                                                                 tiny_qwen3, capsys):
    """Tool rows for a model whose template has no tool syntax stopped the run once the model
    had loaded (with --compare, after the first model's whole evaluation), naming no row."""
    import swiftlite
    from swiftlite.errors import UsageError
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    data = write_jsonl(tmp_path / "d.jsonl", [{"tools": tools, "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}])
    for kw in ({"model": tiny_qwen2}, {"model": tiny_qwen3, "compare": tiny_qwen2}):
        with pytest.raises(UsageError, match=f"{data}:1: it has no place for tools"):
            swiftlite.eval(eval_dataset=[data], output_dir=str(tmp_path / "out"), **kw)
        assert "Loading weights" not in capsys.readouterr().err
        assert not os.path.exists(tmp_path / "out")
