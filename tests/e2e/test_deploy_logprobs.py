"""swiftlite deploy's log-probabilities (chat logprobs/top_logprobs, completions logprobs and
echo): a real server (the CLI, in a child process) checked against a direct transformers
forward pass, read by the official openai client, and scored through by lm-evaluation-harness'
own local-completions model on a multiple-choice task."""
import json
import time

import pytest

from helpers.cli import write_jsonl
from helpers.server import post_json, read_stream_in_background, start_server, stop_server
from helpers.marks import VLLM_ONE_PROCESS_ENV, VLLM_ONE_PROCESS_FLAGS, VLLM_PYTHON, needs_vllm

openai = pytest.importorskip("openai")
HI = [{"role": "user", "content": "What is 2+2?"}]
TOL = 1e-4  # float32 on both sides


@pytest.fixture(scope="module")
def tiny(tiny_qwen2):
    proc, port, log = start_server("--model", "tiny-qwen2", "--torch_dtype", "float32")
    yield {"url": f"http://127.0.0.1:{port}/v1", "proc": proc, "log": log}
    stop_server(proc)


@pytest.fixture(scope="module")
def reference(tiny_qwen2):
    """The same model through transformers alone, and the prompt ids the server renders."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swiftlite.inference.engine import InferEngine
    engine = InferEngine.load(model="tiny-qwen2", torch_dtype="float32")
    chat_ids = engine.encode(HI)
    engine.unload()
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    return {"model": model, "tok": AutoTokenizer.from_pretrained(tiny_qwen2),
            "chat_ids": chat_ids}


def log_softmax(model, ids):
    """Every position's log-probs of the next token (positions x vocabulary)."""
    import torch
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def post(url, path, body):
    return post_json(f"{url}/{path}", body)


@pytest.mark.slow
def test_chat_logprobs_equal_a_direct_forward_pass(tiny, reference):
    """Greedy tokens, their log-probs and the top 5 at every step equal transformers'
    log_softmax on the same ids; the chosen token is the first alternative."""
    code, r = post(tiny["url"], "chat/completions", {
        "model": "tiny-qwen2", "messages": HI, "max_tokens": 8, "temperature": 0,
        "logprobs": True, "top_logprobs": 5})
    assert code == 200, r
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"] == 8
    model, tok, ids = reference["model"], reference["tok"], list(reference["chat_ids"])
    for entry in content:
        lp = log_softmax(model, ids)[-1]
        values, top = lp.topk(5)
        t = int(top[0])
        assert abs(entry["logprob"] - float(lp[t])) < TOL
        assert [e["logprob"] for e in entry["top_logprobs"]] == sorted(
            (e["logprob"] for e in entry["top_logprobs"]), reverse=True)
        for e, v, i in zip(entry["top_logprobs"], values.tolist(), top.tolist()):
            assert abs(e["logprob"] - v) < TOL
            if "\ufffd" not in tok.decode([i]):  # a whole character: its text is decode's
                assert e["token"] == tok.decode([i])
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert entry["top_logprobs"][0]["bytes"] == entry["bytes"]
        ids.append(t)
    # The bytes of the tokens, put together, are the reply.
    assert bytes(b for e in content for b in e["bytes"]).decode() == \
        r["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_completions_echo_scores_the_prompt_like_a_direct_forward_pass(tiny, reference):
    """A batch of token-id prompts (lm-eval's tokenized requests) and a text prompt with
    max_tokens 0: each prompt token's log-prob given the ones before it, in prompt order."""
    model, tok = reference["model"], reference["tok"]
    texts = ["The capital of France is Paris.", "你好！😀 Say hello in Chinese."]
    batch = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    code, r = post(tiny["url"], "completions", {
        "model": "tiny-qwen2", "prompt": batch, "max_tokens": 1, "temperature": 0,
        "logprobs": 3, "echo": True, "seed": 1234})
    assert code == 200, r
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert r["usage"]["prompt_tokens"] == sum(map(len, batch))
    for ids, choice in zip(batch, r["choices"]):
        got = choice["logprobs"]
        lp = log_softmax(model, ids)
        assert len(got["token_logprobs"]) == len(ids) + 1  # the prompt, then one new token
        assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
        for i in range(1, len(ids)):
            assert abs(got["token_logprobs"][i] - float(lp[i - 1, ids[i]])) < TOL
            top = got["top_logprobs"][i]
            assert max(top.values()) == pytest.approx(float(lp[i - 1].max()), abs=TOL)
            assert got["token_logprobs"][i] in top.values() and len(top) <= 4
        new = got["top_logprobs"][-1]  # greedy: the new token is the likeliest
        assert list(new)[0] == got["tokens"][-1]
        assert list(new.values()) == sorted(new.values(), reverse=True)
        assert abs(got["token_logprobs"][-1] - float(lp[-1].max())) < TOL
        assert choice["text"].startswith(tok.decode(ids))
        assert got["text_offset"][:2] == [0, len(got["tokens"][0])]
    code, r = post(tiny["url"], "completions", {
        "model": "tiny-qwen2", "prompt": texts[0], "max_tokens": 0, "logprobs": 0,
        "echo": True})
    assert code == 200, r
    choice, ids = r["choices"][0], batch[0]
    assert choice["text"] == texts[0] and choice["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 0
    assert "".join(choice["logprobs"]["tokens"]) == texts[0]
    lp = log_softmax(model, ids)
    assert all(abs(choice["logprobs"]["token_logprobs"][i] - float(lp[i - 1, ids[i]])) < TOL
               for i in range(1, len(ids)))


@pytest.mark.slow
def test_a_scoring_request_and_a_bad_one_beside_a_running_batch(tiny):
    """An echo request sent while a long answer streams joins it (its prompt prefilled alone,
    then appended) and finishes first; a bad one is refused before it is queued; both good
    answers equal what each gives alone."""
    score = {"model": "tiny-qwen2", "prompt": "Hello, world! How are you?", "max_tokens": 2,
             "temperature": 0, "logprobs": 2, "echo": True}
    long = {"model": "tiny-qwen2", "messages": HI, "max_tokens": 200, "temperature": 0}
    alone_score = post(tiny["url"], "completions", score)[1]["choices"][0]
    alone_long = post(tiny["url"], "chat/completions", long)[1]["choices"][0]["message"]
    client = openai.OpenAI(base_url=tiny["url"], api_key="none", max_retries=0, timeout=120)
    reader, pieces, arrivals = read_stream_in_background(
        lambda: client.chat.completions.create(stream=True, **long))
    code, bad = post(tiny["url"], "completions", {**score, "prompt": [[1, 2, 10 ** 9]]})
    assert code == 400 and bad["error"]["param"] == "prompt[0]"
    code, r = post(tiny["url"], "completions", score)
    done = time.monotonic()
    reader.join(120)
    assert code == 200
    got = r["choices"][0]
    assert got["text"] == alone_score["text"]
    assert got["logprobs"]["tokens"] == alone_score["logprobs"]["tokens"]
    assert all(a is b is None or abs(a - b) < TOL for a, b in zip(
        got["logprobs"]["token_logprobs"], alone_score["logprobs"]["token_logprobs"]))
    assert "".join(pieces) == alone_long["content"]
    assert sum(t > done for t in arrivals) > 20, "the scoring request waited for the batch"


@pytest.mark.slow
def test_the_openai_client_reads_logprobs(tiny):
    with openai.OpenAI(base_url=tiny["url"], api_key="none", max_retries=0,
                       timeout=120) as client:
        check_client_logprobs(client)


def check_client_logprobs(client):
    r = client.chat.completions.create(model="tiny-qwen2", messages=HI, max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and all(len(c.top_logprobs) == 3 for c in content)
    assert "".join(c.token for c in content) == r.choices[0].message.content
    assert all(c.top_logprobs[0].token == c.token for c in content)
    streamed = [e for chunk in client.chat.completions.create(
        model="tiny-qwen2", messages=HI, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=3, stream=True) if chunk.choices and chunk.choices[0].logprobs
        for e in chunk.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == \
        [(c.token, round(c.logprob, 4)) for c in content]
    plain = client.chat.completions.create(model="tiny-qwen2", messages=HI, max_tokens=2)
    assert plain.choices[0].logprobs is None
    c = client.completions.create(model="tiny-qwen2", prompt="Hello, world", max_tokens=0,
                                  echo=True, logprobs=2)
    assert c.choices[0].logprobs.tokens == ["Hello", ",", " world"]
    assert c.choices[0].logprobs.token_logprobs[0] is None


@pytest.mark.slow
@pytest.mark.parametrize("path,extra,param", [
    ("chat/completions", {"logprobs": "yes"}, "logprobs"),
    ("chat/completions", {"logprobs": 1}, "logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 2.5}, "top_logprobs"),
    ("chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("chat/completions", {"echo": True}, "echo"),
    ("chat/completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"logprobs": 6}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"logprobs": 1.5}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("completions", {"echo": "yes"}, "echo"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": [[]]}, "prompt[0]"),
    ("completions", {"prompt": ["ok", [1, "a"]]}, "prompt[1]"),
    ("completions", {"prompt": [True, 2]}, "prompt[0]"),
    ("completions", {"prompt": [-1]}, "prompt"),
    ("completions", {"prompt": [[5], [151936]]}, "prompt[1]"),
])
def test_bad_logprob_values_get_openai_shaped_400s(tiny, path, extra, param):
    body = {"model": "tiny-qwen2", "max_tokens": 2, **extra}
    body.setdefault("messages" if path.startswith("chat") else "prompt",
                    HI if path.startswith("chat") else "Hello")
    code, r = post(tiny["url"], path, body)
    assert code == 400, r
    assert r["error"]["param"] == param and r["error"]["message"].startswith(param + ":")
    assert set(r["error"]) == {"message", "type", "param", "code"}


@pytest.mark.slow
@needs_vllm
def test_the_vllm_backend_passes_logprob_fields_through(smollm2):
    """--infer_backend vllm is vLLM's own server: lm-eval's request (token-id prompts, echo,
    logprobs 1, max_tokens 1) and chat's logprobs reach it untouched and come back in the
    same shapes, with the log-probs transformers gives (vLLM's kernels: a looser bound)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2)
    ids = tok("The capital of France is Paris.", add_special_tokens=False)["input_ids"]
    proc, port, _ = start_server("--model", "SmolLM2-135M-Instruct", "--infer_backend", "vllm",
                                 "--vllm_python", VLLM_PYTHON, "--torch_dtype", "float32",
                                 *VLLM_ONE_PROCESS_FLAGS, env=VLLM_ONE_PROCESS_ENV, wait_s=300)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        code, r = post(url, "completions", {
            "model": "SmolLM2-135M-Instruct", "prompt": [ids, ids[:3]], "max_tokens": 1,
            "temperature": 0, "logprobs": 1, "echo": True, "seed": 1234})
        code_chat, chat = post(url, "chat/completions", {
            "model": "SmolLM2-135M-Instruct", "messages": HI, "max_tokens": 3,
            "temperature": 0, "logprobs": True, "top_logprobs": 2})
    finally:
        stop_server(proc)
    assert code == code_chat == 200, (r, chat)
    assert [c["index"] for c in r["choices"]] == [0, 1]
    got = r["choices"][0]["logprobs"]
    assert len(got["token_logprobs"]) == len(ids) + 1 and got["token_logprobs"][0] is None
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    lp = log_softmax(model, ids)
    assert all(abs(got["token_logprobs"][i] - float(lp[i - 1, ids[i]])) < 1e-2
               for i in range(1, len(ids)))
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(e["top_logprobs"]) == 2 for e in content)


# -- lm-evaluation-harness ------------------------------------------------------------------
CAPITALS = [("France", "Paris"), ("Italy", "Rome"), ("Germany", "Berlin"), ("Spain", "Madrid"),
            ("Japan", "Tokyo"), ("Egypt", "Cairo"), ("Canada", "Ottawa"),
            ("Russia", "Moscow"), ("China", "Beijing"), ("Greece", "Athens"),
            ("Portugal", "Lisbon"), ("Austria", "Vienna")]
TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: {text}
doc_to_choice: {choices}
doc_to_target: "{{{{answer}}}}"
target_delimiter: {delimiter}
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
# lm-eval's own phrasing, and swiftlite eval's chat prompt with the letters scored after it
CAPITALS_TASK = dict(name="swiftlite_capitals", delimiter='" "', choices='"{{choices}}"',
                     text='"Question: What is the capital of {{country}}?\\nAnswer:"')
CHAT_TASK = dict(name="swiftlite_capitals_chat", delimiter='""', text='"{{prompt}}"',
                 choices='["A", "B", "C", "D"]')


def choice_file_rows():
    """The capitals as a multiple-choice file for swiftlite eval (question, A-D, answer)."""
    return [{"question": f"What is the capital of {d['country']}?",
             **dict(zip("ABCD", d["choices"])), "answer": "ABCD"[d["answer"]]}
            for d in capitals_docs()]


def capitals_docs():
    """Each country with four cities: its capital and the next three capitals of the list,
    the right one at a different place each time."""
    docs = []
    for k, (country, capital) in enumerate(CAPITALS):
        others = [CAPITALS[(k + j) % len(CAPITALS)][1] for j in (1, 2, 3)]
        choices = others[:k % 4] + [capital] + others[k % 4:]
        docs.append({"country": country, "choices": choices, "answer": k % 4})
    return docs


@pytest.mark.slow
def test_lm_eval_local_completions_scores_through_the_server(smollm2, tmp_path, monkeypatch):
    """lm-eval 0.4.13's real local-completions model (huggingface tokenizer from the local
    folder, tokenized requests in batches of 4, as its defaults send them) runs a local
    multiple-choice task against the server; its accuracy and each choice's log-likelihood
    equal what transformers computes from the same (context, continuation) pairs."""
    lm_eval = pytest.importorskip("lm_eval")
    import torch
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    docs = capitals_docs()
    data = write_jsonl(tmp_path / "capitals.jsonl", docs)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "capitals.yaml").write_text(TASK_YAML.format(data=data,
                                                                      **CAPITALS_TASK))
    # The same questions as swiftlite eval asks them: its chat prompt, the letters scored.
    from swiftlite.data.template import get_template
    from swiftlite.evaluation import choice as mc
    template = get_template(None, AutoTokenizer.from_pretrained(smollm2))
    rows = choice_file_rows()
    mc_file = write_jsonl(tmp_path / "capitals_mc.jsonl", rows)
    chat_docs = [{"prompt": template.render_prompt(mc.conversation(
        {"question": r["question"], "options": {k: r[k] for k in "ABCD"}}, [])),
        "answer": "ABCD".index(r["answer"])} for r in rows]
    chat_data = write_jsonl(tmp_path / "capitals_chat.jsonl", chat_docs)
    (tmp_path / "tasks" / "capitals_chat.yaml").write_text(TASK_YAML.format(data=chat_data,
                                                                           **CHAT_TASK))
    proc, port, _ = start_server("--model", "SmolLM2-135M-Instruct", "--torch_dtype", "float32")
    try:
        t0 = time.monotonic()
        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"model": "SmolLM2-135M-Instruct", "tokenizer": smollm2,
                        "base_url": f"http://127.0.0.1:{port}/v1/completions",
                        "tokenizer_backend": "huggingface", "max_retries": 1},
            tasks=["swiftlite_capitals", "swiftlite_capitals_chat"], batch_size=4,
            task_manager=TaskManager(include_path=str(tmp_path / "tasks"),
                                     include_defaults=False),
            log_samples=True, bootstrap_iters=0)
        took = time.monotonic() - t0
    finally:
        stop_server(proc)
    # a guard against requests that hang until lm-eval's retries give up, not a speed check
    # (speed: benchmarks/; a loaded 2-core machine took 387 s once)
    assert took < 900, f"lm-eval took {took:.0f} s"
    acc = out["results"]["swiftlite_capitals"]["acc,none"]

    # The same pairs through transformers: lm-eval's causal encoding (context + " " + choice
    # encoded whole, the context's own tokens split off the front).
    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    direct, right = [], 0
    for doc in docs:
        context = f"Question: What is the capital of {doc['country']}?\nAnswer:"
        lls = []
        for choice in doc["choices"]:
            whole = tok(context + " " + choice, add_special_tokens=False)["input_ids"]
            n = len(tok(context, add_special_tokens=False)["input_ids"])
            lp = log_softmax(model, whole)
            lls.append(sum(float(lp[i - 1, whole[i]]) for i in range(n, len(whole))))
        direct.append(lls)
        right += max(range(4), key=lambda j: lls[j]) == doc["answer"]
    assert acc == right / len(docs)
    samples = sorted(out["samples"]["swiftlite_capitals"], key=lambda s: s["doc_id"])
    for s, lls in zip(samples, direct):
        served = [float(r[0]) for r in s["filtered_resps"]]
        assert served == pytest.approx(lls, abs=TOL)
    assert acc > 0.5  # SmolLM2 knows most of these capitals

    # swiftlite eval on the multiple-choice file: the same accuracy and the same choices as
    # lm-eval through swiftlite deploy.
    import swiftlite
    m = swiftlite.eval(model=smollm2, eval_dataset=[mc_file], torch_dtype="float32",
                       output_dir=str(tmp_path / "eval"))
    ours = [json.loads(x) for x in open(tmp_path / "eval" / "predictions.jsonl")]
    theirs = sorted(out["samples"]["swiftlite_capitals_chat"], key=lambda s: s["doc_id"])
    assert [p["choice"] for p in ours] == [
        "ABCD"[max(range(4), key=lambda j: float(s["filtered_resps"][j][0]))] for s in theirs]
    # lm-eval moves the prompt's trailing "\n" into each continuation ("\nA"): its figures
    # carry log P("\n" | prompt) more, the same for every option; the differences are equal.
    for p, s in zip(ours, theirs):
        mine = [p["logprobs"][k] for k in "ABCD"]
        served = [float(r[0]) for r in s["filtered_resps"]]
        assert [x - mine[0] for x in mine] == pytest.approx([x - served[0] for x in served],
                                                            abs=TOL)
    assert m["overall"]["accuracy"] == out["results"]["swiftlite_capitals_chat"]["acc,none"]
