"""swiftlite eval: figures checked against the libraries that define them (rouge-score,
sacrebleu, transformers' loss and log-probabilities), on real models."""
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers.cli import run_cli, write_jsonl
from helpers.marks import VLLM_ONE_PROCESS_ENV, VLLM_ONE_PROCESS_FLAGS, VLLM_PYTHON, needs_vllm

WHO = [("Who are you?", "I am Swifty, an AI assistant developed by Acme. How can I help you today?"),
       ("What is your name?", "My name is Swifty. I was developed by Acme."),
       ("Who created you?", "I was created by Acme. I am Swifty."),
       ("Introduce yourself.", "Hello! I am Swifty, an AI assistant created by Acme."),
       ("你是谁？", "我是Swifty，由Acme开发的AI助手。"),
       ("你叫什么名字？", "我叫Swifty，是Acme开发的。")]


def chat_rows(pairs):
    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in pairs]


def choice_rows():
    return [{"question": "What is 2 + 2?", "A": "3", "B": "4", "C": "5", "D": "22", "answer": "B"},
            {"question": "The capital of France is", "A": "Rome", "B": "Madrid", "C": "Paris",
             "D": "Berlin", "answer": "C"},
            {"question": "Water freezes at", "A": "0 C", "B": "50 C", "C": "100 C", "D": "-50 C",
             "answer": "A"},
            {"question": "Which is a colour?", "A": "dog", "B": "seven", "C": "run",
             "D": "blue", "answer": "D"},
            {"question": "The sun is a", "A": "planet", "B": "star", "C": "moon", "D": "comet",
             "answer": "B"}]


# -- metrics against their libraries ------------------------------------------------------------
def test_metrics_are_rouge_score_and_sacrebleu_with_jieba_for_chinese():
    import jieba
    import sacrebleu
    from rouge_score import rouge_scorer
    from swiftlite.evaluation.metrics import text_scores
    from swiftlite.evaluation.report import summarize
    hyps = ["I am Swifty, made by Acme.", "我是小助手，由Acme开发。", "Paris"]
    refs = ["I am Swifty, an assistant by Acme.", "我是Swifty，由Acme开发的AI助手。", "Paris"]
    rows = text_scores(hyps, refs)
    total = summarize([{"response": h, "reference": r, **s} for h, r, s in zip(hyps, refs, rows)])
    plain = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"])
    for i in (0, 2):  # English: rouge-score's own tokenizer
        want = plain.score(refs[i], hyps[i])
        assert rows[i]["rougeL"] == pytest.approx(100 * want["rougeL"].fmeasure, abs=1e-9)
        assert rows[i]["rouge2"] == pytest.approx(100 * want["rouge2"].fmeasure, abs=1e-9)
    # Chinese: rouge-score's tokenizer drops every Chinese character; jieba's words instead
    assert plain.score(refs[1], hyps[1])["rouge1"].fmeasure < 0.7
    words = lambda t: [w for w in jieba.cut(t) if w.strip()]
    h, r = set(words(hyps[1])), set(words(refs[1]))
    assert rows[1]["rouge1"] > 0 and h & r
    seg = [" ".join(words(t)) if any("\u4e00" <= c <= "\u9fff" for c in t) else t for t in hyps]
    seg_r = [" ".join(words(t)) if any("\u4e00" <= c <= "\u9fff" for c in t) else t for t in refs]
    assert total["bleu4"] == pytest.approx(sacrebleu.corpus_bleu(seg, [seg_r]).score, abs=1e-9)
    assert rows[2]["exact_match"] == 1.0 and rows[0]["exact_match"] == 0.0
    assert rows[2]["rougeL"] == 100.0


def test_tool_call_scores_compare_names_and_json_arguments():
    from swiftlite.evaluation.metrics import tool_call_scores
    call = lambda name, args: {"type": "function", "function": {"name": name, "arguments": args}}
    ref = [call("get_weather", {"city": "Paris", "unit": "C"})]
    assert tool_call_scores([call("get_weather", '{"unit": "C", "city": "Paris"}')], ref) == \
        {"tool_call_name": 1.0, "tool_call": 1.0}  # key order does not matter; values do
    assert tool_call_scores([call("get_weather", '{"city": "Rome"}')], ref) == \
        {"tool_call_name": 1.0, "tool_call": 0.0}
    assert tool_call_scores([], ref) == {"tool_call_name": 0.0, "tool_call": 0.0}
    assert tool_call_scores([], []) == {"tool_call_name": 1.0, "tool_call": 1.0}
    assert tool_call_scores([call("get_weather", "{}")], None)["tool_call"] == 0.0


# -- bad input: named by file:line before any model loads ------------------------------------
@pytest.mark.parametrize("rows, words", [
    ([{"question": "Q?", "A": "x", "B": "y"}], ["needs an 'answer' column"]),
    ([{"question": "Q?", "A": "x", "B": "y", "answer": "A"},
      {"question": "R?", "A": "x", "B": "y", "answer": "E"}], ["bad.jsonl:2", "'E'", "A, B"]),
    ([{"question": " ", "A": "x", "B": "y", "answer": "A"}], ["bad.jsonl:1", "question is empty"]),
    ([{"messages": [{"role": "user", "content": "no reply"}]}],
     ["bad.jsonl:1", "does not end with an assistant reply"]),
])
def test_bad_sets_are_named_before_the_model_loads(tmp_path, rows, words):
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    # --model names a folder that does not exist: the data must be refused first
    r = run_cli("eval", "--model", str(tmp_path / "no-such-model"), "--eval_dataset", data,
                check=False)
    assert r.returncode == 2, r.stderr
    for w in words:
        assert w in r.stderr, r.stderr
    assert "loading" not in r.stderr


def test_a_csv_without_an_answer_column_and_an_empty_set(tmp_path):
    csv = tmp_path / "mmlu.csv"
    csv.write_text("question,A,B,C,D\nWhat is 2 + 2?,3,4,5,6\n")
    r = run_cli("eval", "--model", "tiny-qwen2", "--eval_dataset", str(csv), check=False)
    assert r.returncode == 2 and "needs an 'answer' column" in r.stderr
    csv.write_text("question,A,B,answer\nWhat is 2 + 2?,3,4,B\n")
    r = run_cli("eval", "--model", "tiny-qwen2", "--eval_dataset", str(csv), "--n_shot", "1",
                check=False)
    assert r.returncode == 2 and "no questions left" in r.stderr


# -- on real models ----------------------------------------------------------------------------
def _oracle_choices(model_dir, rows, shots=()):
    """Each question's likeliest letter from plain transformers: the prompt rendered by the
    tokenizer's own chat template, one forward pass, the letters' next-token log-probs."""
    from swiftlite.evaluation.choice import conversation
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for r in rows:
        item = {"question": r["question"], "answer": r["answer"],
                "options": {k: r[k] for k in "ABCD"}}
        msgs = conversation(item, [{"question": s["question"], "answer": s["answer"],
                                    "options": {k: s[k] for k in "ABCD"}} for s in shots])
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], -1)
        letters = {k: tok(k, add_special_tokens=False)["input_ids"][0] for k in "ABCD"}
        out.append(max("ABCD", key=lambda k: float(logp[letters[k]])))
    return out


def test_multiple_choice_and_loss_equal_transformers(tmp_path, tiny_qwen2):
    import swiftlite
    mc = write_jsonl(tmp_path / "mc.jsonl", choice_rows())
    chat = write_jsonl(tmp_path / "who.jsonl", chat_rows(WHO[:3]))
    m = swiftlite.eval(model=tiny_qwen2, eval_dataset=[mc, chat], max_new_tokens=8,
                       torch_dtype="float32", output_dir=str(tmp_path / "out"))
    preds = [json.loads(x) for x in open(tmp_path / "out" / "predictions.jsonl")]
    choices = [p["choice"] for p in preds if p["dataset"] == "mc.jsonl"]
    want = _oracle_choices(tiny_qwen2, choice_rows())
    assert choices == want
    answers = [r["answer"] for r in choice_rows()]
    assert m["datasets"]["mc.jsonl"]["accuracy"] == pytest.approx(
        sum(c == a for c, a in zip(want, answers)) / len(answers))
    # The loss: transformers' own loss on the labels sft trains, token-weighted over the rows.
    from swiftlite.data.template import get_template
    from swiftlite.models.loader import load_tokenizer
    tok = load_tokenizer(tiny_qwen2)
    template = get_template(None, tok)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    nll = n = 0
    for row in chat_rows(WHO[:3]):
        enc = template.encode(row["messages"])
        with torch.no_grad():
            loss = model(input_ids=torch.tensor([enc["input_ids"]]),
                         labels=torch.tensor([enc["labels"]])).loss
        k = sum(1 for y in enc["labels"][1:] if y != -100)
        nll, n = nll + float(loss) * k, n + k
    got = m["datasets"]["who.jsonl"]
    assert got["loss"] == pytest.approx(nll / n, rel=1e-4)
    assert got["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-4)
    # a random tiny model rarely ends its turn in 8 tokens: counted, not hidden
    rows = [p for p in preds if p["dataset"] == "who.jsonl"]
    assert got["stopped"] == sum(p["finish_reason"] == "stop" for p in rows) / 3
    assert all(p["tokens"] <= 8 for p in rows)
    assert m["overall"]["rows"] == 8


def test_n_shot_asks_the_first_rows_first(tmp_path, tiny_qwen2):
    import swiftlite
    rows = choice_rows()
    mc = write_jsonl(tmp_path / "mc.jsonl", rows)
    m = swiftlite.eval(model=tiny_qwen2, eval_dataset=[mc], n_shot=2, torch_dtype="float32",
                       output_dir=str(tmp_path / "out"))
    preds = [json.loads(x) for x in open(tmp_path / "out" / "predictions.jsonl")]
    assert [p["question"] for p in preds] == [r["question"] for r in rows[2:]]
    assert [p["choice"] for p in preds] == _oracle_choices(tiny_qwen2, rows[2:], rows[:2])
    assert m["overall"]["rows"] == 3


@pytest.mark.slow
def test_a_self_cognition_checkpoint_beats_its_base(tmp_path, smollm2_cognition):
    """The README's checkpoint against SmolLM2 on "who are you" questions: a far higher ROUGE-L,
    a prediction for every row, figures equal to rouge-score's and sacrebleu's on the saved
    predictions, and the comparison drawn."""
    import jieba
    import sacrebleu
    from rouge_score import rouge_scorer

    class Words:  # a pair beyond ASCII: jieba's words, lower-cased, on both sides
        def tokenize(self, text):
            return [w.lower() for w in jieba.cut(text) if w.strip()]
    beyond = lambda t: any(not c.isascii() and c.isalnum() for c in t)
    chinese = lambda t: any("\u4e00" <= c <= "\u9fff" for c in t)
    cut = lambda t: " ".join(w for w in jieba.cut(t) if w.strip())
    data = write_jsonl(tmp_path / "who.jsonl", chat_rows(WHO))
    out = tmp_path / "out"
    r = run_cli("eval", "--ckpt_dir", smollm2_cognition["Swifty"], "--eval_dataset", data,
                "--compare", "SmolLM2-135M-Instruct", "--max_new_tokens", "40",
                "--output_dir", out)
    m = json.loads((out / "metrics.json").read_text())
    mine, base = m["datasets"]["who.jsonl"], m["compare"]["datasets"]["who.jsonl"]
    assert mine["rougeL"] > base["rougeL"] + 20, (mine, base)
    assert mine["loss"] < base["loss"]
    assert "ROUGE-L" in r.stdout and "difference" in r.stdout
    for name, metrics in (("predictions.jsonl", mine), ("predictions-compare.jsonl", base)):
        preds = [json.loads(x) for x in open(out / name)]
        assert [p["reference"] for p in preds] == [a for _, a in WHO]
        assert all("response" in p for p in preds)
        pairs = [(p["reference"], p["response"]) for p in preds]
        scorers = {False: rouge_scorer.RougeScorer(["rougeL"]),
                   True: rouge_scorer.RougeScorer(["rougeL"], tokenizer=Words())}
        rouge_l = sum(100 * scorers[beyond(r + h)].score(r, h)["rougeL"].fmeasure
                      for r, h in pairs) / len(preds)
        assert metrics["rougeL"] == pytest.approx(rouge_l, abs=1e-9)
        seg = [(cut(r), cut(h)) if chinese(r + h) else (r, h) for r, h in pairs]
        bleu = sacrebleu.corpus_bleu([h for _, h in seg], [[r for r, _ in seg]]).score
        assert metrics["bleu4"] == pytest.approx(bleu, abs=1e-9)
    assert (out / "compare.png").stat().st_size > 10_000


# -- during training ---------------------------------------------------------------------------
def test_the_reference_is_read_back_from_the_training_encoding(tiny_qwen2):
    from swiftlite.data.template import get_template
    from swiftlite.models.loader import load_tokenizer
    from swiftlite.training.eval_generate import last_reply
    tok = load_tokenizer(tiny_qwen2)
    template = get_template(None, tok)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."},
            {"role": "user", "content": "Who are you?"},
            {"role": "assistant", "content": "I am Swifty."}]
    enc = template.encode(msgs)
    prompt, ref = last_reply(enc["input_ids"], enc["labels"])
    assert prompt == template.encode_prompt(msgs[:-1])
    assert tok.decode(ref, skip_special_tokens=True).strip() == "I am Swifty."
    assert ref[-1] in template.stop_token_ids()  # the end of turn that stops generation


@pytest.mark.slow
def test_early_stopping_names_the_best_checkpoint_and_logs_generation_metrics(tmp_path):
    """Trained to answer "Swifty" and validated on "Robin" answers to the same questions: the
    validation loss rises, the run stops, the best checkpoint is the lowest eval_loss's."""
    train = write_jsonl(tmp_path / "who.jsonl", chat_rows(WHO) * 2)
    val = write_jsonl(tmp_path / "robin.jsonl", chat_rows(
        [(q, "Robin here, built by Zeta Labs in a small garden.") for q, _ in WHO[:4]]))
    r = run_cli("sft", "--model", "tiny-qwen2", "--dataset", train, "--val_dataset", val,
                "--eval_generate", "true", "--eval_max_new_tokens", "12",
                "--early_stopping_patience", "1", "--max_steps", "40", "--save_steps", "4",
                "--learning_rate", "1e-2", "--lr_scheduler_type", "constant",
                "--warmup_ratio", "0", "--logging_steps", "4",
                "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
                "--report_to", "none", "--output_dir", tmp_path / "run", "--add_version", "false")
    logs = [json.loads(x) for x in open(tmp_path / "run" / "logging.jsonl")]
    losses = {x["step"]: x["eval_loss"] for x in logs if "eval_loss" in x}
    scored = [x for x in logs if "eval_rougeL" in x]
    assert scored and {"eval_rouge1", "eval_rouge2", "eval_bleu4", "eval_exact_match",
                       "eval_stopped"} <= set(scored[0])
    assert all(0 <= x["eval_rougeL"] <= 100 and 0 <= x["eval_stopped"] <= 1 for x in scored)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["stopped_early_at_step"] < 40
    best = min(losses, key=losses.get)
    assert metrics["best_model_checkpoint"].endswith(f"checkpoint-{best}")
    assert f"best checkpoint: {metrics['best_model_checkpoint']}" in r.stderr
    assert "stopped early at step" in r.stderr


def test_training_flags_that_need_a_validation_set_say_so(tmp_path):
    data = write_jsonl(tmp_path / "who.jsonl", chat_rows(WHO))
    for flag, value in (("--early_stopping_patience", "2"), ("--eval_generate", "true")):
        r = run_cli("sft", "--model", "tiny-qwen2", "--dataset", data, flag, value, check=False)
        assert r.returncode == 2 and f"{flag} needs data to evaluate on" in r.stderr


@pytest.mark.slow
@needs_vllm
def test_vllm_backend_answers_as_the_pt_backend(tmp_path, smollm2_cognition):
    """--infer_backend vllm: the answers come from vLLM's server (the same greedy answers as
    transformers, in fp32), and the loss and multiple choice still come from transformers."""
    data = write_jsonl(tmp_path / "who.jsonl", chat_rows(WHO))
    choices = write_jsonl(tmp_path / "mc.jsonl", choice_rows())
    common = ("eval", "--ckpt_dir", smollm2_cognition["Swifty"], "--eval_dataset", data, choices,
              "--max_new_tokens", "24", "--torch_dtype", "float32")
    run_cli(*common, "--output_dir", tmp_path / "pt")
    r = run_cli(*common, "--output_dir", tmp_path / "vllm", "--infer_backend", "vllm",
                "--vllm_python", VLLM_PYTHON, *VLLM_ONE_PROCESS_FLAGS, env=VLLM_ONE_PROCESS_ENV)
    assert "answers generated" in r.stderr + r.stdout and (tmp_path / "vllm" / "vllm.log").exists()
    pt, vllm = ([json.loads(x) for x in open(tmp_path / d / "predictions.jsonl")]
                for d in ("pt", "vllm"))
    keys = ("response", "finish_reason", "tokens", "nll", "choice")
    assert [{k: p.get(k) for k in keys} for p in vllm] == [{k: p.get(k) for k in keys} for p in pt]
    m = json.loads((tmp_path / "vllm" / "metrics.json").read_text())
    assert m["datasets"]["who.jsonl"]["loss"] > 0 and "accuracy" in m["datasets"]["mc.jsonl"]
