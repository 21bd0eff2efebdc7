"""swiftlite rlhf: preference data in every format, its encoding, the log-probs against plain
transformers, each method training for real on tiny models, resume, the checkpoint in
merge-lora and infer, and an adapter that learned the preference (judged by plain peft)."""
from __future__ import annotations

import json
import math
import os
import random

import pytest
import torch

from helpers.cli import run_cli, write_jsonl

PROMPT = [{"role": "user", "content": "What is 2 plus 3?"}]
GOOD = {"role": "assistant", "content": "2 plus 3 is 5."}
BAD = {"role": "assistant", "content": "No idea."}
# one pair in every supported layout -> the same canonical pair
LAYOUTS = {
    "pair-messages": {"messages": PROMPT + [GOOD], "rejected_response": BAD["content"]},
    "pair-messages (rejected_messages)": {"messages": PROMPT + [GOOD],
                                          "rejected_messages": PROMPT + [BAD]},
    "pair-trl (conversational)": {"prompt": PROMPT, "chosen": [GOOD], "rejected": [BAD]},
    "pair-trl (strings)": {"prompt": PROMPT[0]["content"], "chosen": GOOD["content"],
                           "rejected": BAD["content"]},
    "pair-trl (implicit prompt)": {"chosen": PROMPT + [GOOD], "rejected": PROMPT + [BAD]},
    "pair-sharegpt": {"conversations": [{"from": "human", "value": PROMPT[0]["content"]}],
                      "chosen": {"from": "gpt", "value": GOOD["content"]},
                      "rejected": {"from": "gpt", "value": BAD["content"]}},
    "pair-alpaca": {"instruction": PROMPT[0]["content"], "chosen": GOOD["content"],
                    "rejected": BAD["content"]},
    # the prompt under other names (Intel/orca_dpo_pairs: question), or as messages
    "pair-trl (question)": {"question": PROMPT[0]["content"], "chosen": GOOD["content"],
                            "rejected": BAD["content"]},
    "pair-trl (query)": {"query": PROMPT[0]["content"], "chosen": GOOD["content"],
                         "rejected": BAD["content"]},
    "pair-trl (messages)": {"messages": PROMPT, "chosen": GOOD["content"],
                            "rejected": BAD["content"]},
    # HuggingFaceH4/ultrafeedback_binarized: a string prompt, and whole conversations
    "pair-trl (prompt and conversations)": {"prompt": PROMPT[0]["content"],
                                            "chosen": PROMPT + [GOOD], "rejected": PROMPT + [BAD]},
    "pair-trl (implicit prompt, strings)": {
        "chosen": f"{PROMPT[0]['content']}\n{GOOD['content']}",
        "rejected": f"{PROMPT[0]['content']}\n{BAD['content']}"},
}


def arithmetic_pairs(n: int, seed: int) -> list[dict]:
    """Pairs whose chosen reply answers a sum and whose rejected reply dodges it."""
    rng = random.Random(seed)
    dodges = ["I don't know.", "Ask someone else.", "No idea, sorry.", "Why do you ask?"]
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 30), rng.randint(1, 30)
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}],
                     "chosen": [{"role": "assistant", "content": f"{a} plus {b} is {a + b}."}],
                     "rejected": [{"role": "assistant", "content": rng.choice(dodges)}]})
    return rows


@pytest.fixture(scope="session")
def pairs_jsonl(tmp_path_factory) -> str:
    return write_jsonl(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", arithmetic_pairs(64, 0))


TINY = dict(model="tiny-qwen2", per_device_train_batch_size=4, gradient_accumulation_steps=1,
            learning_rate=2e-2, logging_steps=1, report_to="none", torch_dtype="float32")


def read_log(run_dir: str) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(run_dir, "logging.jsonl"))]


@pytest.fixture(scope="session")
def dpo_run(tmp_path_factory, tiny_qwen2, pairs_jsonl):
    """An 8-step sigmoid DPO run on tiny-qwen2, checkpoints at 4 and 8."""
    import swiftlite
    return swiftlite.rlhf(dataset=[pairs_jsonl], max_steps=8, save_steps=4,
                          output_dir=str(tmp_path_factory.mktemp("dpo_run")), **TINY)


# -- data -------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_gives_the_same_pair(layout, tmp_path):
    from swiftlite.data import load_datasets
    path = write_jsonl(tmp_path / "p.jsonl", [LAYOUTS[layout]])
    (pair,) = load_datasets([path], task="preference").train
    assert pair["messages"] == PROMPT and pair["chosen"] == GOOD and pair["rejected"] == BAD
    assert pair["where"] == f"{path}:1"


@pytest.mark.parametrize("row", [
    {"system": "Be brief.", "question": PROMPT[0]["content"], "chosen": GOOD["content"],
     "rejected": BAD["content"]},
    {"system": "Be brief.", "prompt": PROMPT, "chosen": [GOOD], "rejected": [BAD]},
    {"system": "Be brief.", "instruction": PROMPT[0]["content"], "chosen": GOOD["content"],
     "rejected": BAD["content"]},
])
def test_a_system_prompt_beside_the_pair_comes_first(row, tmp_path):
    from swiftlite.data import load_datasets
    (pair,) = load_datasets([write_jsonl(tmp_path / "p.jsonl", [row])], task="preference").train
    assert pair["messages"] == [{"role": "system", "content": "Be brief."}, *PROMPT]


def test_kto_rows_and_pairs_split_into_labelled_rows(tmp_path):
    from swiftlite.data import load_datasets
    from swiftlite.data.pairs import unpair
    kto = write_jsonl(tmp_path / "k.jsonl", [{"messages": PROMPT + [GOOD], "label": True},
                                             {"messages": PROMPT + [BAD], "label": False}])
    trl = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "Hi", "completion": "Hello", "label": False}])
    rows = list(load_datasets([kto], task="preference").train)
    assert [(r["completion"], r["label"]) for r in rows] == [(GOOD, True), (BAD, False)]
    (row,) = load_datasets([trl], task="preference").train
    assert row["messages"] == [{"role": "user", "content": "Hi"}] and row["label"] is False
    pair = load_datasets([write_jsonl(tmp_path / "p.jsonl", [LAYOUTS["pair-alpaca"]])],
                         task="preference").train
    assert [(r["completion"], r["label"]) for r in unpair(list(pair))] == [(GOOD, True),
                                                                           (BAD, False)]
    # a CSV carries its labels as text
    (tmp_path / "k.csv").write_text("prompt,completion,label\nHi,Hello,true\nHi,Bye,False\n")
    rows = list(load_datasets([str(tmp_path / "k.csv")], task="preference").train)
    assert [r["label"] for r in rows] == [True, False]


def test_labelled_rows_after_pairs_are_refused_by_file_and_line(tmp_path):
    """A pair file then a KTO file was a KeyError once the model had loaded."""
    pairs = write_jsonl(tmp_path / "p.jsonl", [LAYOUTS["pair-trl (conversational)"]])
    kto = write_jsonl(tmp_path / "k.jsonl", [{"messages": PROMPT + [GOOD], "label": True}])
    for streaming in ("false", "true"):
        r = run_cli("rlhf", "--model", "tiny-qwen2", "--dataset", pairs, kto, "--streaming",
                    streaming, "--max_steps", "2", "--output_dir", tmp_path / "out", check=False)
        assert r.returncode == 2 and f"{kto}:1: these rows are unpaired" in r.stderr, r.stderr
        assert "Loading weights" not in r.stderr


@pytest.mark.parametrize("row,reason", [
    ({"messages": PROMPT + [GOOD]}, "unknown preference dataset format"),
    ({"prompt": PROMPT, "chosen": [GOOD], "rejected": None}, "'rejected' is missing"),
    ({"messages": PROMPT + [GOOD], "label": "yes"}, "'label' must be true or false"),
    ({"prompt": PROMPT + [GOOD], "chosen": [GOOD], "rejected": [BAD]},
     "the prompt ends with an assistant turn"),
    ({"chosen": PROMPT + [GOOD], "rejected": [{"role": "user", "content": "Other"}, BAD]},
     "must be the same conversation"),
])
def test_bad_rows_are_named_by_file_and_line(row, reason, tmp_path):
    from swiftlite.data import load_datasets
    from swiftlite.errors import UsageError
    good = LAYOUTS["pair-trl (conversational)"] if "label" not in row else \
        {"messages": PROMPT + [GOOD], "label": True}
    first = row if "unknown" in reason else good
    path = write_jsonl(tmp_path / "bad.jsonl", [first, row])
    with pytest.raises(UsageError) as e:
        load_datasets([path], task="preference")
    line = 1 if "unknown" in reason else 2
    assert f"{path}:{line}" in str(e.value) and reason in str(e.value)


def test_bad_pair_stops_the_command_before_the_model_loads(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [LAYOUTS["pair-trl (conversational)"],
                                                {"prompt": PROMPT, "chosen": [GOOD]}])
    r = run_cli("rlhf", "--model", "tiny-qwen2", "--dataset", path, "--output_dir",
                tmp_path / "out", check=False)
    assert r.returncode == 2, r.stderr
    assert f"{path}:2: 'rejected' is missing" in r.stderr
    assert "Loading weights" not in r.stderr and not (tmp_path / "out").exists()


def test_sft_names_preference_rows_and_rlhf_needs_pairs(tmp_path):
    pairs = write_jsonl(tmp_path / "p.jsonl", [LAYOUTS["pair-trl (conversational)"]])
    r = run_cli("sft", "--model", "tiny-qwen2", "--dataset", pairs, check=False)
    assert r.returncode == 2 and "train on them with swiftlite rlhf" in r.stderr
    kto = write_jsonl(tmp_path / "k.jsonl", [{"messages": PROMPT + [GOOD], "label": True}])
    r = run_cli("rlhf", "--model", "tiny-qwen2", "--dataset", kto, check=False)
    assert r.returncode == 2 and "--rlhf_type kto" in r.stderr


def test_arguments_are_checked_together():
    from swiftlite.config.rlhf_args import RlhfArguments
    from swiftlite.errors import UsageError
    with pytest.raises(UsageError) as e:
        RlhfArguments(model="m", dataset=["d"], rlhf_type="orpo", loss_type="ipo",
                      rpo_alpha=1.0, precompute_ref_log_probs=True, beta=-1.0).validate()
    msg = str(e.value)
    for part in ("--loss_type ipo with --rlhf_type orpo", "--rpo_alpha is DPO's",
                 "has no reference model", "--beta must be positive"):
        assert part in msg
    with pytest.raises(UsageError, match="per_device_train_batch_size 2 or more"):
        RlhfArguments(model="m", dataset=["d"], rlhf_type="kto").validate()
    with pytest.raises(UsageError, match="--rlhf_type kto with --train_type full"):
        RlhfArguments(model="m", dataset=["d"], rlhf_type="kto", train_type="full",
                      per_device_train_batch_size=2).validate()
    # a method's own settings given to another, where they would be recorded and ignored
    for extra, words in (({"label_smoothing": 0.1}, "--label_smoothing with --rlhf_type dpo "
                                                    "--loss_type sigmoid"),
                         ({"rlhf_type": "orpo", "label_smoothing": 0.1}, "--rlhf_type orpo"),
                         ({"rlhf_type": "simpo", "cpo_alpha": 0.5}, "--cpo_alpha is CPO's"),
                         ({"simpo_gamma": 0.5}, "--simpo_gamma is SimPO's"),
                         ({"desirable_weight": 2.0}, "--desirable_weight is KTO's")):
        with pytest.raises(UsageError, match=words):
            RlhfArguments(model="m", dataset=["d"], **extra).validate()
    for fine in ({"loss_type": "robust", "label_smoothing": 0.1},
                 {"rlhf_type": "simpo", "label_smoothing": 0.1, "simpo_gamma": 0.5},
                 {"rlhf_type": "cpo", "cpo_alpha": 0.5}):
        RlhfArguments(model="m", dataset=["d"], **fine).validate()
    # KTO's KL pairs a prompt with another row's completion: an evaluation batch needs two
    args = RlhfArguments(model="m", dataset=["d"], rlhf_type="kto", per_device_train_batch_size=4,
                         split_dataset_ratio=0.1).validate()
    assert args.per_device_eval_batch_size == 4


def test_pairs_share_the_prompt_ids_and_match_sft_encoding(tiny_qwen2):
    """chosen and rejected start with the ids of the prompt rendered with the generation
    header; each equals SFT's encoding of prompt + reply, labels on the reply and its end of
    turn only."""
    from swiftlite.data.pair_encode import encode_preferences
    from swiftlite.data.template import get_template
    from swiftlite.models.loader import load_tokenizer
    tok = load_tokenizer(tiny_qwen2, False)
    t = get_template(None, tok)
    rows = [{"messages": PROMPT, "chosen": GOOD, "rejected": BAD}]
    ds, report = encode_preferences(rows, t, unpaired=False, max_length=512, use_cache=False)
    prompt_ids = t.encode_prompt(PROMPT)
    for key, reply in (("chosen", GOOD), ("rejected", BAD)):
        ids, labels = ds[0][f"{key}_input_ids"], ds[0][f"{key}_labels"]
        assert ids[:len(prompt_ids)] == prompt_ids
        assert set(labels[:len(prompt_ids)]) == {-100}
        sft = t.encode(PROMPT + [reply])
        assert (ids, labels) == (sft["input_ids"], sft["labels"])
        trained = tok.decode([x for x in labels if x != -100])
        assert trained == reply["content"] + "<|im_end|>"
    assert ds[0]["prompt_length"] == len(prompt_ids)


def test_over_long_pairs_are_counted():
    from swiftlite.data.pair_encode import encode_preferences
    from swiftlite.data.template import get_template
    from swiftlite.models import resolve_model
    from swiftlite.models.loader import load_tokenizer
    t = get_template(None, load_tokenizer(resolve_model("tiny-qwen2")[0], False))
    rows = [{"messages": PROMPT, "chosen": GOOD, "rejected": BAD},
            {"messages": PROMPT, "chosen": GOOD, "rejected": GOOD},
            {"messages": [{"role": "user", "content": "word " * 300}], "chosen": GOOD,
             "rejected": BAD}]
    ds, report = encode_preferences(rows, t, unpaired=False, max_length=64, use_cache=False)
    assert len(ds) == 2 and report.dropped["longer than max_length 64"] == 1
    assert report.dropped["identical chosen and rejected (kept; they teach nothing)"] == 1
    ds, report = encode_preferences(rows, t, unpaired=False, max_length=64, use_cache=False,
                                    truncation_strategy="left")
    assert len(ds) == 3 and report.truncated == 1
    assert max(len(ds[2]["chosen_input_ids"]), len(ds[2]["rejected_input_ids"])) == 64


# -- log-probs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("padding_free", [True, False])
def test_sequence_logps_equal_a_plain_transformers_recomputation(tiny_qwen2, padding_free):
    from transformers import AutoModelForCausalLM

    from swiftlite.data.pair_encode import encode_preferences
    from swiftlite.data.template import get_template
    from swiftlite.models.loader import load_tokenizer
    from swiftlite.training.preference.collator import PreferenceCollator
    from swiftlite.training.preference.logps import sequence_logps
    tok = load_tokenizer(tiny_qwen2, False)
    rows = [{"messages": r["prompt"], "chosen": r["chosen"][0], "rejected": r["rejected"][0]}
            for r in arithmetic_pairs(3, 1)]
    ds, _ = encode_preferences(rows, get_template(None, tok), unpaired=False, max_length=512,
                               use_cache=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    batch = PreferenceCollator(tok.pad_token_id, padding_free)([ds[i] for i in range(3)])
    with torch.no_grad():
        sums, counts = sequence_logps(model, batch, batch["num_sequences"])
        for i, key in enumerate(["chosen"] * 3 + ["rejected"] * 3):
            row = ds[i % 3]
            ids = torch.tensor([row[f"{key}_input_ids"]])
            labels = torch.tensor(row[f"{key}_labels"])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            keep = labels[1:] != -100
            want = logp[keep].gather(1, labels[1:][keep][:, None]).sum()
            assert counts[i].item() == keep.sum().item()
            assert sums[i].item() == pytest.approx(want.item(), abs=1e-4)


def test_log_probs_give_gradients_with_a_onednn_marked_head():
    """A head weight marked for oneDNN (swiftlite's speed-up where oneDNN measures faster: a
    coin toss on CPUs where the two rates are close) must still pass gradients: oneDNN's fp32
    linear has no backward, and through it the policy's log-probs had none (the first steps'
    gradient norm was 0, at random from one process to the next)."""
    from swiftlite.training.preference.logps import token_logps
    from swiftlite.training.speedups import onednn_fp32
    torch.manual_seed(0)
    weight = torch.randn(50, 16)
    setattr(weight, onednn_fp32.MARK, True)
    targets = torch.randint(0, 50, (7,))
    grads = []
    for chunk in (3, 100):
        hidden = torch.randn(7, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        token_logps(hidden, weight, targets, chunk=chunk).sum().backward()
        grads.append(hidden.grad)
    hidden = grads[0].new_tensor(torch.randn(7, 16, generator=torch.Generator().manual_seed(1)),
                                 requires_grad=True)
    torch.log_softmax(hidden @ weight.t(), -1).gather(1, targets[:, None]).sum().backward()
    for g in grads:
        torch.testing.assert_close(g, hidden.grad)


# -- training -----------------------------------------------------------------------------------
def test_first_sigmoid_loss_is_ln2_and_the_margin_grows(dpo_run):
    rows = [r for r in read_log(dpo_run.output_dir) if "loss" in r]
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert rows[0]["rewards/margins"] == 0
    assert rows[-1]["rewards/margins"] > 0 and rows[-1]["loss"] < math.log(2)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen",
                "logps/rejected"):
        assert key in rows[-1]
    images = os.listdir(os.path.join(dpo_run.output_dir, "images"))
    assert {"train_loss.png", "train_rewards_margins.png", "train_rewards_accuracies.png"} \
        <= set(images)
    args = json.load(open(os.path.join(dpo_run.output_dir, "args.json")))
    assert (args["rlhf_type"], args["loss_type"], args["beta"]) == ("dpo", "sigmoid", 0.1)


@pytest.mark.slow
def test_first_loss_is_ln2_with_the_default_dtype_and_speedups(pairs_jsonl, tmp_path):
    """The default (bf16 base, fp32 activations, fused LoRA, ... on a bf16 CPU): the policy
    with fresh adapters and the reference with them off give the same log-probs."""
    import swiftlite
    run = swiftlite.rlhf(dataset=[pairs_jsonl], max_steps=1, output_dir=str(tmp_path),
                         **{**TINY, "torch_dtype": "auto"})
    assert read_log(run.output_dir)[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)


@pytest.mark.slow
@pytest.mark.slow
def test_first_loss_is_ln2_when_the_adapter_init_moves_the_base(pairs_jsonl, tmp_path):
    """PiSSA and OLoRA move part of each weight into the adapter: switched off, it leaves the
    residual, not the starting model, so the reference is the starting model's, precomputed
    (and cached apart from a default init's). No dropout: on a PiSSA adapter (B not 0) it
    would change the policy's first step."""
    import swiftlite
    from swiftlite.config.rlhf_args import RlhfArguments
    from swiftlite.errors import UsageError
    init = "pissa_niter_2"  # OLoRA takes the same path
    for i, how in enumerate((init, "true")):
        run = swiftlite.rlhf(dataset=[pairs_jsonl], max_steps=1, init_lora_weights=how,
                             precompute_ref_log_probs=True, lora_dropout=0.0,
                             output_dir=str(tmp_path / str(i)), **TINY)
        assert read_log(run.output_dir)[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    with pytest.raises(UsageError, match=f"--init_lora_weights {init} with --rlhf_type kto"):
        RlhfArguments(model="m", dataset=["d"], rlhf_type="kto", init_lora_weights=init,
                      per_device_train_batch_size=2).validate()


@pytest.mark.slow
def test_resume_matches_uninterrupted(dpo_run, pairs_jsonl, tmp_path):
    import swiftlite
    resumed = swiftlite.rlhf(dataset=[pairs_jsonl], max_steps=8, save_steps=4,
                             output_dir=str(tmp_path), resume_from_checkpoint=os.path.join(
                                 dpo_run.output_dir, "checkpoint-4"), **TINY)
    full = {r["step"]: r["loss"] for r in read_log(dpo_run.output_dir) if "loss" in r}
    after = {r["step"]: r["loss"] for r in read_log(resumed.output_dir) if "loss" in r}
    assert sorted(after) == [5, 6, 7, 8]
    for step, loss in after.items():
        assert loss == pytest.approx(full[step], abs=1e-4), (step, loss, full[step])


@pytest.mark.slow
@pytest.mark.parametrize("method", [
    dict(rlhf_type="dpo", loss_type="ipo"), dict(rlhf_type="dpo", rpo_alpha=1.0),
    dict(rlhf_type="cpo"), dict(rlhf_type="simpo"), dict(rlhf_type="orpo"),
    dict(rlhf_type="kto"), dict(rlhf_type="dpo", precompute_ref_log_probs=True),
    dict(rlhf_type="dpo", padding_free=False)])
def test_each_method_trains(method, pairs_jsonl, tmp_path):
    """The same batch at every step (4 pairs; KTO: 2 pairs as 4 rows): its loss falls."""
    import swiftlite
    n = 2 if method["rlhf_type"] == "kto" else 4
    run = swiftlite.rlhf(dataset=[f"{pairs_jsonl}#{n}"], max_steps=4, output_dir=str(tmp_path),
                         **{**TINY, **method})
    rows = [r for r in read_log(run.output_dir) if "loss" in r]
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert rows[-1]["rewards/margins"] > rows[0]["rewards/margins"]
    assert os.path.isfile(os.path.join(run.last_checkpoint, "adapter_model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-qwen2.5", "tiny-qwen3"])
def test_qwen25_and_qwen3_templates_train(model, pairs_jsonl, tmp_path):
    """Their official templates (Qwen2.5's default system prompt, Qwen3's think block in the
    last reply) encode pairs that share the prompt, and DPO starts at ln 2 and learns."""
    import swiftlite
    run = swiftlite.rlhf(dataset=[f"{pairs_jsonl}#4"], max_steps=3, output_dir=str(tmp_path),
                         **{**TINY, "model": model})
    rows = [r for r in read_log(run.output_dir) if "loss" in r]
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert rows[-1]["rewards/margins"] > 0


@pytest.mark.parametrize("rlhf_type", ["dpo", pytest.param("kto", marks=pytest.mark.slow)])
def test_streaming_pairs(rlhf_type, pairs_jsonl, tmp_path):
    """--streaming reads, checks and encodes pairs (KTO: split into labelled rows) as training
    consumes them; a bad row is named by file:line when training reaches it."""
    import swiftlite
    from swiftlite.errors import UsageError
    run = swiftlite.rlhf(dataset=[pairs_jsonl], max_steps=2, streaming=True,
                         shuffle_buffer_size=8, rlhf_type=rlhf_type,
                         output_dir=str(tmp_path / "ok"), **TINY)
    rows = [r for r in read_log(run.output_dir) if "loss" in r]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    stream = json.load(open(os.path.join(run.output_dir, "metrics.json")))["dataset_stream"]
    assert stream["rows"] >= 8 and stream["skipped"] == {}
    bad = write_jsonl(tmp_path / "bad.jsonl", arithmetic_pairs(3, 5) + [
        {"prompt": PROMPT, "chosen": [GOOD]}])
    with pytest.raises(UsageError, match=f"{bad}:4: 'rejected' is missing"):
        swiftlite.rlhf(dataset=[bad], max_steps=2, streaming=True, shuffle_buffer_size=2,
                       rlhf_type=rlhf_type, output_dir=str(tmp_path / "bad"), **TINY)


@pytest.mark.slow
def test_the_checkpoint_merges_and_answers(dpo_run, tmp_path):
    ckpt = os.path.join(dpo_run.output_dir, "checkpoint-8")
    out = tmp_path / "merged"
    r = run_cli("merge-lora", "--ckpt_dir", ckpt, "--output_dir", out)
    assert os.path.isfile(out / "config.json")
    # merge-lora's own check of the merged model against base + adapter
    diff = float(r.stdout.split("max |logit difference| adapter vs merged:")[1].split()[0])
    assert diff < 1e-4
    r = run_cli("infer", "--ckpt_dir", ckpt, "--query", "What is 2 plus 3?",
                "--max_new_tokens", "8")
    assert r.returncode == 0 and "Traceback" not in r.stderr


@pytest.mark.slow
def test_the_checkpoint_is_served_with_the_same_greedy_answer(dpo_run):
    """swiftlite deploy serves the preference-trained adapter like an SFT one: the official
    openai client gets the greedy answer `swiftlite infer` gives."""
    import openai

    from helpers.server import start_server, stop_server
    ckpt = os.path.join(dpo_run.output_dir, "checkpoint-8")
    want = run_cli("infer", "--ckpt_dir", ckpt, "--query", "What is 2 plus 3?",
                   "--max_new_tokens", "12").stdout.strip()
    proc, port, _ = start_server("--ckpt_dir", ckpt, "--served_model_name", "dpo")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        r = client.chat.completions.create(model="dpo", max_tokens=12, temperature=0,
                                           messages=[{"role": "user",
                                                      "content": "What is 2 plus 3?"}])
        assert r.choices[0].message.content.strip() == want
    finally:
        stop_server(proc)


@pytest.mark.slow
def test_qlora_4bit(pairs_jsonl, tmp_path):
    """DPO on a 4-bit base (bitsandbytes): the reference is the quantized base with the adapters
    off, so the first loss is ln 2 there too, and the margin grows."""
    import swiftlite
    run = swiftlite.rlhf(dataset=[f"{pairs_jsonl}#4"], max_steps=3, quant_bits=4,
                         output_dir=str(tmp_path), **{**TINY, "torch_dtype": "auto"})
    rows = [r for r in read_log(run.output_dir) if "loss" in r]
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert rows[-1]["rewards/margins"] > 0
    assert os.path.isfile(os.path.join(run.last_checkpoint, "adapter_model.safetensors"))


def _margins(model, tok, template, rows) -> list[float]:
    """(log p(chosen) - log p(rejected)) per pair, by plain transformers."""
    out = []
    for r in rows:
        values = []
        for reply in (r["chosen"][0], r["rejected"][0]):
            prompt = tok.apply_chat_template(r["prompt"], tokenize=False,
                                             add_generation_prompt=True)
            full = tok.apply_chat_template(r["prompt"] + [reply], tokenize=False)
            p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([tok(full, add_special_tokens=False)["input_ids"]])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            targets = ids[0, 1:]
            values.append(logp[len(p_ids) - 1:].gather(1, targets[len(p_ids) - 1:, None]).sum())
        out.append((values[0] - values[1]).item())
    return out


@pytest.mark.slow
def test_smollm2_learns_to_prefer_held_out_chosen_replies(smollm2, tmp_path):
    """DPO on SmolLM2-135M-Instruct; on held-out pairs, judged by plain peft + transformers
    outside swiftlite: the adapter raises log p(chosen) - log p(rejected) over the base's."""
    import swiftlite
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    train = write_jsonl(tmp_path / "train.jsonl", arithmetic_pairs(48, 1))
    # 3 steps at 2e-3: all 12 held-out margins up, by 64.7 on average, the least by 61.0 (AVX2
    # AMD EPYC, fp32, 2026-12-07; 6 steps at 1e-3: 72.5 on an Intel AMX host), far above what
    # the test asks
    run = swiftlite.rlhf(model="SmolLM2-135M-Instruct", dataset=[train], max_steps=3,
                         per_device_train_batch_size=4, gradient_accumulation_steps=1,
                         learning_rate=2e-3, logging_steps=1, report_to="none",
                         warmup_ratio=0.0, output_dir=str(tmp_path / "out"))
    held_out = arithmetic_pairs(12, 99)
    tok = AutoTokenizer.from_pretrained(run.last_checkpoint)
    base = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    before = _margins(base, tok, None, held_out)
    tuned = PeftModel.from_pretrained(base, run.last_checkpoint).eval()
    after = _margins(tuned, tok, None, held_out)
    better = sum(a > b for a, b in zip(after, before))
    assert better >= 11, (before, after)
    assert sum(after) / len(after) > sum(before) / len(before) + 1.0


# -- DeepSpeed ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dpo_single(pairs_jsonl, tmp_path_factory):
    """The reference run: one process, 4 pairs a step, no dropout (the ranks' sums are the same)."""
    import swiftlite
    run = swiftlite.rlhf(dataset=[pairs_jsonl], max_steps=3, save_steps=100, lora_dropout=0.0,
                         output_dir=str(tmp_path_factory.mktemp("dpo_single")),
                         **{**TINY, "learning_rate": 5e-3})
    return [(r["step"], r["loss"], r["rewards/margins"]) for r in read_log(run.output_dir)
            if "loss" in r]


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_zero_on_two_processes_equals_one(stage, dpo_single, pairs_jsonl, tmp_path):
    """2 processes x 2 pairs = 1 process x 4 pairs, step by step; under ZeRO-3 the reference
    (adapters off) and the policy both run on partitioned weights."""
    from test_deepspeed import child_env, free_port, the_run_dir
    run_cli("rlhf", "--model", "tiny-qwen2", "--dataset", pairs_jsonl, "--max_steps", "3",
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
            "--learning_rate", "5e-3", "--logging_steps", "1", "--lora_dropout", "0",
            "--report_to", "none", "--torch_dtype", "float32", "--save_steps", "3",
            "--deepspeed", stage, "--output_dir", tmp_path,
            env=child_env(NPROC_PER_NODE=2, MASTER_PORT=free_port()))
    run_dir = the_run_dir(tmp_path)
    got = [(r["step"], r["loss"], r["rewards/margins"]) for r in read_log(run_dir) if "loss" in r]
    assert [s for s, _, _ in got] == [s for s, _, _ in dpo_single]
    for (step, loss, margin), (_, loss1, margin1) in zip(got, dpo_single):
        assert loss == pytest.approx(loss1, abs=1e-4), (step, loss, loss1)
        assert margin == pytest.approx(margin1, abs=1e-4), (step, margin, margin1)
    from safetensors.torch import load_file
    tensors = load_file(os.path.join(run_dir, "checkpoint-3", "adapter_model.safetensors"))
    assert tensors and all(t.numel() > 0 for t in tensors.values())  # no empty ZeRO-3 shards


def test_estimate_counts_two_sequences_per_pair():
    from swiftlite.config.arguments import EstimateArguments
    from swiftlite.estimate.plan import for_training, run
    from swiftlite.config.rlhf_args import RlhfArguments
    common = dict(model="Qwen2-1.5B-Instruct", max_length=1024)
    act = lambda **kw: [r["gpu"]["activations"] for r in  # noqa: E731
                        run(EstimateArguments(**common, **kw))["rows"]]
    assert act(batch_size=2, rlhf_type="dpo") == act(batch_size=4)
    assert act(batch_size=2, rlhf_type="kto") == act(batch_size=2)
    # --deepspeed auto: the estimate of an rlhf run carries its method
    est = for_training(RlhfArguments(model="Qwen2-1.5B-Instruct", dataset=["d"],
                                     rlhf_type="orpo"), torch_dtype="bfloat16")
    assert est.rlhf_type == "orpo"


@pytest.mark.slow
def test_early_stopping_on_swapped_validation_pairs(pairs_jsonl, tmp_path):
    """Validated on the same kind of pairs with chosen and rejected swapped, the DPO loss on
    them rises as training works: the run stops early and names its best checkpoint."""
    import swiftlite
    swapped = [{**p, "chosen": p["rejected"], "rejected": p["chosen"]}
               for p in arithmetic_pairs(8, 7)]
    val = write_jsonl(tmp_path / "swapped.jsonl", swapped)
    run = swiftlite.rlhf(dataset=[pairs_jsonl], val_dataset=[val], max_steps=40, save_steps=2,
                         early_stopping_patience=1, output_dir=str(tmp_path / "run"), **TINY)
    metrics = json.load(open(os.path.join(run.output_dir, "metrics.json")))
    losses = {r["step"]: r["eval_loss"] for r in read_log(run.output_dir) if "eval_loss" in r}
    assert metrics["stopped_early_at_step"] < 40
    best = min((s for s in losses if s <= metrics["stopped_early_at_step"]), key=losses.get)
    assert metrics["best_model_checkpoint"].endswith(f"checkpoint-{best}")
