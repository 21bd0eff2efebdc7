"""#40's pre-flight checks: each fires on a case made to fail and stays silent on a good one."""
from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def template():
    from swiftlite.data.template import get_template
    from swiftlite.models.builtin import build
    from swiftlite.models.loader import load_tokenizer
    tokenizer = load_tokenizer(build("tiny-qwen2.5"))
    return get_template(None, tokenizer)


def _conversation(reply_words: int) -> list:
    return [{"role": "user", "content": "Tell me about rivers."},
            {"role": "assistant", "content": " ".join(["water"] * reply_words)}]


def test_end_of_turn_trained_in_every_sample_or_counted(template, capfd):
    """Cut from the right at --max_length, long samples lose their last reply's end-of-turn
    token: counted as such; samples that fit (or deleted ones) leave nothing to say."""
    from swiftlite.data.encode import encode_dataset, warn_if_end_of_turn_untrained
    convs = [_conversation(5), _conversation(5), _conversation(200), _conversation(300)]
    ds, _ = encode_dataset(convs, template, max_length=64, truncation_strategy="right",
                           use_cache=False)
    capfd.readouterr()
    assert warn_if_end_of_turn_untrained(ds, template, 64) == 2
    err = capfd.readouterr().err
    assert "2 of 4 samples do not end with a trained end-of-turn token" in err
    assert "2 of them reach --max_length 64" in err
    ds, _ = encode_dataset(convs, template, max_length=64, truncation_strategy="delete",
                           use_cache=False)
    assert warn_if_end_of_turn_untrained(ds, template, 64) == 0
    assert "end-of-turn" not in capfd.readouterr().err


@pytest.mark.parametrize("case", ["whole", "zero3_partition", "non_finite"])
def test_saved_adapter_checked_before_the_checkpoint_is_marked_complete(tmp_path, case):
    """An adapter saved with an empty tensor (a ZeRO-3 partition where the gathered weight
    belongs) or a non-finite value is never marked complete, and the run stops saying why;
    a whole one is marked."""
    import types

    import torch
    from safetensors.torch import save_file

    from swiftlite.errors import RunError
    from swiftlite.runtime.output import is_complete
    from swiftlite.training.callbacks import ADAPTER_FILE, CheckpointArgs
    ckpt = tmp_path / "checkpoint-3"
    ckpt.mkdir()
    a = torch.ones(8, 64)
    b = {"whole": torch.zeros(64, 8), "zero3_partition": torch.empty(0),
         "non_finite": torch.full((64, 8), float("nan"))}[case]
    save_file({"base_model.model.q_proj.lora_A.weight": a,
               "base_model.model.q_proj.lora_B.weight": b}, str(ckpt / ADAPTER_FILE))
    args, state = types.SimpleNamespace(output_dir=str(tmp_path)), types.SimpleNamespace(
        global_step=3)
    callback = CheckpointArgs(str(tmp_path))
    if case == "whole":
        callback.on_save(args, state, None)
        assert is_complete(str(ckpt))
        return
    with pytest.raises(RunError, match="empty tensor.*ZeRO-3 partitions.*stage3_gather"
                       if case == "zero3_partition" else "non-finite.*--learning_rate"):
        callback.on_save(args, state, None)
    assert not is_complete(str(ckpt))


def _adapter(model_dir, folder, **config):
    """A real peft adapter of model_dir saved in folder."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    get_peft_model(base, LoraConfig(r=8, task_type="CAUSAL_LM", **config)).save_pretrained(
        str(folder))
    return str(folder)


def test_deploy_vllm_names_adapters_vllm_cannot_serve(tmp_path):
    """deploy --infer_backend vllm refuses, before anything starts, a checkpoint vLLM cannot
    load as a LoRA adapter (DoRA, modules_to_save, an unconverted PiSSA, LoRA on the LM
    head), naming what and the way out (merge first); a plain adapter passes."""
    from swiftlite.config.parsing import build
    from swiftlite.config.arguments import DeployArguments
    from swiftlite.errors import UsageError
    from swiftlite.inference.server.vllm_lora import check_adapters
    from swiftlite.models.builtin import build as build_model
    from swiftlite.pipelines.deploy import serve_vllm
    model = build_model("tiny-qwen2.5")
    plain = _adapter(model, tmp_path / "plain", target_modules=["q_proj", "v_proj"])
    check_adapters({"plain": plain})
    bad = _adapter(model, tmp_path / "bad", target_modules=["q_proj", "lm_head"],
                   use_dora=True, modules_to_save=["embed_tokens"])
    pissa = _adapter(model, tmp_path / "pissa", target_modules=["q_proj"],
                     init_lora_weights="pissa_niter_1")
    args = build(DeployArguments, {"ckpt_dir": bad, "model": model, "infer_backend": "vllm",
                                   "adapters": [f"pissa={pissa}", f"plain={plain}"]})
    with pytest.raises(UsageError) as e:
        serve_vllm(args)
    message = str(e.value)
    assert "DoRA (use_dora)" in message and "modules_to_save embed_tokens" in message
    assert "LoRA on lm_head" in message
    assert "init_lora_weights pissa_niter_1 not converted" in message
    assert f"swiftlite merge-lora --ckpt_dir {bad}" in message and "--infer_backend pt" in message
    assert plain not in message


def test_eval_vllm_refuses_an_adapter_vllm_cannot_serve_before_it_starts(tmp_path):
    """eval --infer_backend vllm takes deploy's pre-flight: a DoRA adapter is refused with the
    way out before vLLM starts or anything is written."""
    from swiftlite.errors import UsageError
    from swiftlite.models.builtin import build as build_model
    from swiftlite.pipelines.eval import eval as evaluate
    model = build_model("tiny-qwen2.5")
    dora = _adapter(model, tmp_path / "dora", target_modules=["q_proj"], use_dora=True)
    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                             {"role": "assistant", "content": "Hello"}]}) + "\n")
    with pytest.raises(UsageError, match=r"DoRA \(use_dora\)[\s\S]*swiftlite merge-lora"):
        evaluate(ckpt_dir=dora, model=model, eval_dataset=[str(data)], infer_backend="vllm",
                 vllm_python=str(tmp_path / "no-vllm" / "python"),
                 output_dir=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def cut_rows(tmp_path_factory):
    """Chat rows and preference pairs whose replies half of which --max_length 64 cuts."""
    from helpers.cli import write_jsonl
    folder = tmp_path_factory.mktemp("cut")
    convs = [_conversation(words) for words in (5, 200, 6, 300)]
    pairs = [{"prompt": c[:1], "chosen": c[1:], "rejected": [{"role": "assistant", "content": "No."}]}
             for c in convs]
    return (write_jsonl(folder / "chat.jsonl", [{"messages": c} for c in convs]),
            write_jsonl(folder / "pairs.jsonl", pairs))


TRUNCATING = dict(model="tiny-qwen2.5", max_steps=1, per_device_train_batch_size=2,
                  max_length=64, truncation_strategy="right", torch_dtype="float32",
                  report_to="none", load_from_cache_file=False)


@pytest.mark.slow
def test_a_run_that_cut_end_of_turn_tokens_is_named_by_merge_and_deploy(cut_rows, tmp_path, capfd):
    """sft counts the samples whose end-of-turn token truncation cut, and records the count;
    merge-lora and deploy say so before they start; a run that lost none stays silent."""
    import swiftlite
    from swiftlite.config.arguments import DeployArguments, MergeArguments
    from swiftlite.pipelines import deploy, merge
    run = swiftlite.sft(dataset=[cut_rows[0]], output_dir=str(tmp_path / "cut"), **TRUNCATING)
    assert "2 of 4 samples do not end with a trained end-of-turn token" in capfd.readouterr().err
    report = json.load(open(f"{run.last_checkpoint}/args.json"))["dataset_report"]
    assert report["end_of_turn_untrained"] == 2
    merge.run(MergeArguments(ckpt_dir=run.last_checkpoint, output_dir=str(tmp_path / "merged"),
                             verify=False))
    assert "trained on 2 samples whose reply did not end" in capfd.readouterr().err
    deploy.load(DeployArguments(ckpt_dir=run.last_checkpoint, torch_dtype="float32"))
    assert "trained on 2 samples whose reply did not end" in capfd.readouterr().err
    whole = swiftlite.sft(dataset=[cut_rows[0]], output_dir=str(tmp_path / "whole"),
                          **{**TRUNCATING, "max_length": 1024})
    deploy.load(DeployArguments(ckpt_dir=whole.last_checkpoint, torch_dtype="float32"))
    assert "end-of-turn" not in capfd.readouterr().err


def test_rlhf_checks_the_chosen_replies_end_of_turn(cut_rows, tmp_path, capfd):
    import swiftlite
    run = swiftlite.rlhf(dataset=[cut_rows[1]], output_dir=str(tmp_path / "dpo"), **TRUNCATING)
    err = capfd.readouterr().err
    assert "2 of 4 pairs' chosen replies do not end with a trained end-of-turn token" in err
    assert "2 of them reach --max_length 64" in err
    report = json.load(open(f"{run.last_checkpoint}/args.json"))["dataset_report"]
    assert report["end_of_turn_untrained"] == 2
