"""Qwen3's thinking mode, one --enable_thinking flag from training to serving: a tiny-qwen3 run
trained with thinking off records it, saves a template that defaults to it, and infer, deploy
(transformers and the files vLLM reads), merge-lora and export keep it unless told otherwise,
with a warning when told otherwise."""
import json
import os

import pytest
from transformers import AutoTokenizer

USER = [{"role": "user", "content": "2+2?"}]
EMPTY_THINK = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def thinking_off(tmp_path_factory, chat_jsonl) -> str:
    """The checkpoint of a 2-step tiny-qwen3 LoRA run with --enable_thinking false."""
    import swiftlite
    run = swiftlite.sft(model="tiny-qwen3", dataset=[chat_jsonl + "#8"], max_steps=2,
                        per_device_train_batch_size=4, gradient_accumulation_steps=1,
                        enable_thinking=False, torch_dtype="float32", report_to="none",
                        output_dir=str(tmp_path_factory.mktemp("thinking_off")))
    return run.last_checkpoint


def prompt(folder: str, **switch) -> str:
    """What plain transformers renders with the folder's saved chat template."""
    tok = AutoTokenizer.from_pretrained(folder)
    return tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True, **switch)


def test_the_run_records_its_setting_and_saves_a_template_that_defaults_to_it(thinking_off):
    assert json.load(open(os.path.join(thinking_off, "args.json")))["enable_thinking"] is False
    assert prompt(thinking_off).endswith("<|im_start|>assistant\n" + EMPTY_THINK)
    assert prompt(thinking_off, enable_thinking=True).endswith("<|im_start|>assistant\n")


def test_infer_uses_the_trained_setting_and_warns_when_told_otherwise(thinking_off, capfd):
    from swiftlite.inference.engine import InferEngine
    engine = InferEngine.load(thinking_off, torch_dtype="float32")
    assert engine.template.enable_thinking is False
    assert engine.template.render_prompt(USER).endswith(EMPTY_THINK)
    assert "WARNING" not in capfd.readouterr().err
    engine = InferEngine.load(thinking_off, torch_dtype="float32", enable_thinking=True)
    assert not engine.template.render_prompt(USER).endswith(EMPTY_THINK)
    err = capfd.readouterr().err
    assert "--enable_thinking true" in err and "trained with enable_thinking false" in err


def test_vllm_gets_the_trained_setting_as_its_template_default(thinking_off, tmp_path):
    """deploy --infer_backend vllm: the chat template file vLLM reads renders the empty think
    block when a request sets no chat_template_kwargs."""
    from jinja2 import Environment
    from swiftlite.inference.checkpoints import describe
    from swiftlite.inference.server.vllm_backend import write_serving_files
    files = write_serving_files(describe(thinking_off), str(tmp_path))
    source = open(files["chat_template"], encoding="utf-8").read()
    assert source == AutoTokenizer.from_pretrained(thinking_off).chat_template
    rendered = Environment().from_string(source).render(messages=USER, add_generation_prompt=True)
    assert rendered.endswith(EMPTY_THINK)


@pytest.mark.slow
def test_merge_and_export_keep_it(thinking_off, tmp_path):
    from swiftlite.config.arguments import MergeArguments
    from swiftlite.export.modelfile import go_template
    from swiftlite.inference.checkpoints import describe, training_template
    from swiftlite.pipelines import merge
    out = merge.run(MergeArguments(ckpt_dir=thinking_off, output_dir=str(tmp_path / "merged"),
                                   verify=False))
    assert json.load(open(os.path.join(out, "swiftlite.json")))["enable_thinking"] is False
    assert prompt(out).endswith(EMPTY_THINK)
    merged = describe(model=out)
    assert merged.enable_thinking is False
    template = training_template(merged)[1]
    assert "thinking off unless asked" in go_template(template)[1]  # the Modelfile's TEMPLATE
    # merge-lora --enable_thinking true writes the other default, and says it differs
    out = merge.run(MergeArguments(ckpt_dir=thinking_off, output_dir=str(tmp_path / "on"),
                                   verify=False, enable_thinking=True))
    assert not prompt(out).endswith(EMPTY_THINK)


def test_a_model_without_the_switch_refuses_the_flag(tiny_qwen2):
    from swiftlite.errors import UsageError
    from swiftlite.inference.engine import InferEngine
    with pytest.raises(UsageError, match="no enable_thinking switch"):
        InferEngine.load(None, "tiny-qwen2", enable_thinking=False)
