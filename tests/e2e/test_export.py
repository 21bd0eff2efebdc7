"""swiftlite export --format gguf|gguf-lora, checked by the real parts: llama.cpp's converter and
quantizer make the files, llama.cpp itself (llama-cpp-python, in its venv) loads and answers
them, gguf-py reads their metadata, and Go's own text/template renders the Modelfile's
TEMPLATE against the Jinja rendering of the checkpoint's template.

Cost: each export runs llama.cpp's converter in a child process (torch + transformers import,
then the vocabulary: 10-20 s for these small models on 2 cores); each file is made once per
session (fixtures) and shared by the tests that read it."""
from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys

import pytest

from helpers.cli import REPO, run_cli
from helpers.marks import LLAMACPP_PYTHON, LLAMACPP_VENV, needs_go, needs_llamacpp

import swiftlite
from swiftlite.errors import UsageError

ENV = {"SWIFTLITE_LLAMACPP_VENV": LLAMACPP_VENV}
WHO = [{"role": "user", "content": "Who are you?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string"}},
                   "required": ["city"]}}}]
CALL = [{"type": "function", "function": {"name": "get_weather",
                                          "arguments": {"city": "Paris", "unit": "C"}}}]
CONVERSATIONS = {
    "one turn": ([{"role": "user", "content": "Hi"}], None),
    "system, several turns": ([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy? 你好"},
        {"role": "assistant", "content": "Rome."}], None),
    "tools, calls, results": ([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": CALL},
        {"role": "tool", "content": "18"}, {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "18 C and sunny."},
        {"role": "user", "content": "Thanks"}], TOOLS),
    "tools, no system, text and two calls": ([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": CALL + CALL},
        {"role": "tool", "content": "18"}], TOOLS),
    "thinking": ([
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."}], None),
}


# -- Go's text/template against the Jinja template ------------------------------------------------
@pytest.fixture(scope="session")
def go_render(tmp_path_factory):
    """render(template, messages, tools, think) with Go's text/template on Ollama's data."""
    binary = str(tmp_path_factory.mktemp("go") / "ollama_template")
    src = os.path.join(REPO, "tests", "helpers", "ollama_template", "main.go")
    subprocess.run(["go", "build", "-o", binary, src], check=True, capture_output=True,
                   env={**os.environ, "GO111MODULE": "off"})

    def render(template, messages, tools=None, think=None) -> str:
        r = subprocess.run([binary], input=json.dumps({"template": template, "messages": messages,
                                                       "tools": tools, "think": think}),
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return r.stdout
    return render


def json_lines(text: str) -> str:
    """The text with each line that is a JSON value written one way: Go's JSON (Ollama's) is
    compact with sorted keys, Python's (the Jinja's tojson) has ", " and ": "; the values
    must be the same."""
    out = []
    for line in text.split("\n"):
        if line.startswith("{"):
            try:
                line = json.dumps(json.loads(line), sort_keys=True, separators=(",", ":"))
            except ValueError:
                pass
        out.append(line)
    return "\n".join(out)


@needs_go
@pytest.mark.parametrize("system", [None, "You are Swifty, made by Acme."])
@pytest.mark.parametrize("alias,family", [
    ("tiny-qwen2", "qwen"), ("SmolLM2-135M-Instruct", "smollm"),
    ("tiny-qwen2.5", "Qwen2.5"), ("tiny-qwen3", "Qwen3")])
def test_modelfile_template_renders_like_the_jinja_template(go_render, tmp_path, alias, family,
                                                             system):
    """The TEMPLATE written into the Modelfile, rendered by Go as Ollama renders it (SYSTEM sent
    as the first message when a conversation has none), equals the checkpoint's Jinja
    rendering of the same conversation: system prompts, several turns, tools, tool calls,
    grouped tool results, Qwen3's thinking (up to the spacing of JSON values)."""
    from swiftlite.data.template import get_template
    from swiftlite.export.modelfile import go_template, write_modelfile
    from swiftlite.models.builtin import build
    from swiftlite.models.loader import load_tokenizer
    folder = build(alias)
    template = get_template(None, load_tokenizer(folder), system=system)
    go, name = go_template(template)
    assert go is not None and name.startswith(family)
    path = str(tmp_path / "Modelfile")
    write_modelfile(path, "./x.gguf", template, system, folder)
    text = open(path, encoding="utf-8").read()
    assert f'TEMPLATE """{go}"""\n' in text  # Ollama's parser reads it back whole
    assert ('SYSTEM """' in text) == (system is not None)
    assert 'PARAMETER stop "<|im_end|>"' in text
    compared = 0
    for case, (messages, tools) in CONVERSATIONS.items():
        if (tools or case == "thinking") and not template.supports_tools:
            continue
        ollama_messages = messages if system is None or messages[0]["role"] == "system" else \
            [{"role": "system", "content": system}] + messages
        for think in ([None, False] if family == "Qwen3" and case == "one turn" else [None]):
            gen = messages[-1]["role"] != "assistant"  # Ollama: the reply follows
            jinja = template.render(messages, add_generation_prompt=gen, tools=tools)[0] \
                if think is None else template.tokenizer.apply_chat_template(
                    ollama_messages, tokenize=False, add_generation_prompt=gen,
                    enable_thinking=False)
            rendered = go_render(go, ollama_messages, tools, think)
            if tools:
                assert json_lines(rendered) == json_lines(jinja), case
            else:
                assert rendered == jinja, case
            compared += 1
    assert compared >= (2 if not template.supports_tools else 5)


@needs_go
def test_a_run_trained_without_thinking_gets_a_template_that_thinks_only_when_asked(go_render):
    """--enable_thinking false: Ollama's think unset renders as the saved Jinja template does
    with no keyword (the empty think block, as trained); think=true and false as the Jinja
    with that keyword."""
    from swiftlite.data.template import get_template
    from swiftlite.export.modelfile import go_template
    from swiftlite.models.builtin import build
    from swiftlite.models.loader import load_tokenizer
    tok = load_tokenizer(build("tiny-qwen3"))
    template = get_template(None, tok, enable_thinking=False)
    go, family = go_template(template)
    tok.chat_template = template.to_jinja()
    messages = [{"role": "user", "content": "2+2?"}]
    for think in (None, False, True):
        switch = {} if think is None else {"enable_thinking": think}
        jinja = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                        **switch)
        assert go_render(go, messages, None, think) == jinja, think
        assert jinja.endswith("<think>\n\n</think>\n\n") == (think is not True)


def test_a_template_without_a_go_version_writes_no_template(tmp_path):
    """An unknown model template: no TEMPLATE (Ollama then picks one from the GGUF's chat
    template), said in the Modelfile, rather than a wrong one."""
    from transformers import AutoTokenizer

    from swiftlite.data.template import get_template
    from swiftlite.export.modelfile import write_modelfile
    from swiftlite.models.builtin import build
    tok = AutoTokenizer.from_pretrained(build("tiny-qwen2"))
    tok.chat_template = ("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}"
                         "<|im_end|>{% endfor %}{% if add_generation_prompt %}<<assistant>>"
                         "{% endif %}")
    path = str(tmp_path / "Modelfile")
    family = write_modelfile(path, "./x.gguf", get_template(None, tok), None, str(tmp_path))
    text = open(path, encoding="utf-8").read()
    assert "TEMPLATE" not in text.split("\n", 1)[1] and "no Go version" in family
    assert "FROM ./x.gguf" in text and 'PARAMETER stop "<|im_end|>"' in text


# -- llama.cpp itself ------------------------------------------------------------------------------
def llamacpp(tmp_path, model, jobs=(), lora=None, render=(), logprobs=()) -> dict:
    """Greedy answers, rendered prompts and log-probs of a GGUF through llama-cpp-python
    (tests/helpers/llamacpp_generate.py)."""
    job = tmp_path / f"job-{len(os.listdir(tmp_path))}.json"
    job.write_text(json.dumps({"model": model, "lora": lora, "jobs": list(jobs),
                               "render": list(render), "logprobs": list(logprobs)}))
    r = subprocess.run([LLAMACPP_PYTHON, os.path.join(REPO, "tests", "helpers",
                                                      "llamacpp_generate.py"), str(job)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def transformers_greedy(model_dir, prompt_ids, max_new_tokens, adapter=None, eos=None):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter)
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=eos, pad_token_id=eos[0] if eos else None)
    return out[0, len(prompt_ids):].tolist()


def checkpoint_template(path):
    from swiftlite.inference.checkpoints import describe, training_template
    return training_template(describe(path))[1]


@pytest.fixture(scope="session")
def swifty_f16(smollm2_cognition, tmp_path_factory):
    """The Swifty SmolLM2 adapter exported as f16 (merged first): the GGUF's path."""
    out = tmp_path_factory.mktemp("export") / "swifty-gguf"
    return swiftlite.export(ckpt_dir=smollm2_cognition["Swifty"], quant="f16",
                            output_dir=str(out), llamacpp_venv=LLAMACPP_VENV)


@pytest.mark.slow
@needs_llamacpp
def test_f16_gguf_answers_like_transformers_and_carries_the_template(swifty_f16,
                                                                     smollm2_cognition, smollm2,
                                                                     tmp_path):
    """f16 of a trained SmolLM2 adapter: llama.cpp's greedy tokens are transformers' (adapter
    on the fp32 base); it stops at the end-of-turn token, as swiftlite does; the GGUF's chat
    template is the checkpoint's byte for byte, <|im_end|> its EOS and EOT."""
    ckpt = smollm2_cognition["Swifty"]
    out = os.path.dirname(swifty_f16)
    assert os.path.basename(swifty_f16) == "cognition_swifty0-checkpoint-4-f16.gguf"
    assert sorted(os.listdir(out)) == [".swiftlite-output.json", "Modelfile",
                                       os.path.basename(swifty_f16)]
    assert not [d for d in os.listdir(os.path.dirname(out)) if ".tmp-" in d]
    template = checkpoint_template(ckpt)
    end = template.tokenizer.convert_tokens_to_ids("<|im_end|>")
    modelfile = open(os.path.join(out, "Modelfile"), encoding="utf-8").read()
    assert f"FROM ./{os.path.basename(swifty_f16)}\n" in modelfile
    assert 'TEMPLATE """' in modelfile and 'PARAMETER stop "<|im_end|>"' in modelfile

    prompt = template.encode_prompt(WHO)
    mine = transformers_greedy(smollm2, prompt, 40, adapter=ckpt, eos=template.stop_token_ids())
    answer = llamacpp(tmp_path, swifty_f16, [{"prompt_ids": prompt, "max_tokens": 40}])
    fields = answer["metadata"]
    assert fields["tokenizer.chat_template"] == template.to_jinja()
    assert fields["tokenizer.ggml.eos_token_id"] == fields["tokenizer.ggml.eot_token_id"] == str(end)
    assert fields["general.architecture"] == "llama"
    got = answer["results"][0]
    assert got["tokens"][:8] == mine[:8], (got["text"], template.tokenizer.decode(mine))
    assert got["stopped"] and got["tokens"][-1] == end and mine[-1] == end
    assert "Swifty" in got["text"]


HELD_OUT = ("Rivers carry water from mountains to the sea. Along the way they shape valleys, "
            "feed farms and cities, and give homes to fish and birds. When heavy rain falls, a "
            "river can rise quickly and flood the land around it.")


@pytest.mark.slow
@needs_llamacpp
def test_f16_log_probs_of_a_held_out_text_agree_with_transformers(swifty_f16, smollm2_cognition,
                                                                  smollm2, tmp_path):
    """Per-token log-probabilities of a text the adapter never saw, through llama.cpp's f16 GGUF
    and through transformers (the adapter on the fp32 base): the same up to f16 rounding."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    ids = AutoTokenizer.from_pretrained(smollm2)(HELD_OUT)["input_ids"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
        smollm2, dtype=torch.float32), smollm2_cognition["Swifty"])
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].double(), -1)
    mine = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    got = torch.tensor(llamacpp(tmp_path, swifty_f16, logprobs=[ids])["logprobs"][0],
                       dtype=torch.float64)
    diff = (got - mine).abs()
    assert len(ids) > 40 and diff.mean() < 0.02 and diff.max() < 0.2, (diff.mean(), diff.max())
    assert abs(got.mean() - mine.mean()) < 0.01  # the perplexities agree within 1%


def gguf_tensors(path) -> dict:
    import numpy as np
    from gguf import GGUFReader
    return {t.name: np.array(t.data) for t in GGUFReader(path).tensors}


@pytest.mark.slow
@needs_llamacpp
def test_the_converter_merges_the_adapter_as_merge_lora_does(swifty_f16, smollm2_cognition,
                                                               tmp_path):
    """swifty_f16's adapter was merged by llama.cpp's converter as it converted (the base read
    once, export/converter_merge.py); merged by merge-lora in fp32 and then converted, it gives
    the same f16 GGUF tensors, bit for bit."""
    import numpy as np

    from swiftlite.export.converter_merge import plan
    from swiftlite.inference.checkpoints import describe
    ckpt = smollm2_cognition["Swifty"]
    assert plan(ckpt, describe(ckpt).base_dir) is not None  # the path swifty_f16 took
    merged = swiftlite.merge_lora(ckpt, str(tmp_path / "merged"), torch_dtype="float32",
                                  verify=False)
    other = swiftlite.export(ckpt_dir=merged, quant="f16", output_dir=str(tmp_path / "gguf"),
                             llamacpp_venv=LLAMACPP_VENV)
    mine, theirs = gguf_tensors(swifty_f16), gguf_tensors(other)
    assert mine.keys() == theirs.keys() and len(mine) > 200
    assert [k for k in mine if not np.array_equal(mine[k], theirs[k])] == []


@pytest.mark.slow  # a llama.cpp conversion: not for the inner loop
@needs_llamacpp
@pytest.mark.parametrize("model", ["tiny_qwen2", "smollm2"])
def test_the_converter_under_swiftlite_writes_what_it_writes_alone(model, request, tmp_path):
    """llamacpp_child.py runs llama.cpp's converter with the weights cast to f16 as they load
    and the f16 cast done by torch: with no metadata to set and nothing to merge, the GGUF is
    the one the converter writes alone, byte for byte (Qwen2 and Llama, fp32 weights)."""
    from swiftlite.export.gguf import _CHILD, Llamacpp
    llama = Llamacpp(LLAMACPP_VENV)
    converter = os.path.join(llama.share, "convert_hf_to_gguf.py")
    (tmp_path / "none.json").write_text("{}")
    for out, cmd in (("alone.gguf", [converter]),
                     ("child.gguf", [_CHILD, "convert", converter, tmp_path / "none.json", "-"])):
        subprocess.run([llama.python, *cmd, request.getfixturevalue(model), "--outtype", "f16",
                        "--outfile", tmp_path / out], check=True, capture_output=True)
    assert (tmp_path / "alone.gguf").read_bytes() == (tmp_path / "child.gguf").read_bytes()


@pytest.mark.slow  # a llama.cpp conversion: not for the inner loop
@needs_llamacpp
def test_an_adapter_the_converter_cannot_merge_is_merged_into_a_folder_first(tiny_qwen2,
                                                                           tmp_path):
    """A DoRA adapter (peft's merge only) takes the folder merge; llama.cpp's log-probs of the
    exported GGUF are the adapter's through peft."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                   use_dora=True, init_lora_weights=False))
    model.save_pretrained(tmp_path / "dora")
    r = run_cli("export", "--ckpt_dir", tmp_path / "dora", "--quant", "f16", "--output_dir",
                tmp_path / "out", "--name", "dora", env=ENV)
    assert "merging the adapter into its base first" in r.stderr, r.stderr[-2000:]
    ids = AutoTokenizer.from_pretrained(tiny_qwen2)(HELD_OUT)["input_ids"]

    def logprobs():
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].double(), -1)
        return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    mine = logprobs()
    with model.disable_adapter():
        plain = logprobs()
    got = torch.tensor(llamacpp(tmp_path, str(tmp_path / "out" / "dora-f16.gguf"),
                                logprobs=[ids])["logprobs"][0], dtype=torch.float64)
    assert (got - mine).abs().max() < 0.05 < (plain - mine).abs().max(), (
        (got - mine).abs().max(), (plain - mine).abs().max())


@pytest.mark.slow
@needs_llamacpp
def test_q4_k_m_export_by_the_cli_answers_with_the_taught_name(smollm2_cognition, swifty_f16,
                                                               tmp_path):
    """The issue's first 'done when': swiftlite export --quant q4_k_m on the self-cognition
    checkpoint; llama.cpp loads it and answers "who are you" with the name it was taught.
    The f16 intermediate is gone; the folder of an earlier export is replaced only with
    --exist_ok, anything else never."""
    ckpt = smollm2_cognition["Swifty"]
    out = tmp_path / "q4"
    r = run_cli("export", "--ckpt_dir", ckpt, "--quant", "q4_k_m", "--output_dir", out,
                "--name", "swifty", env=ENV)
    gguf_file = str(out / "swifty-q4_k_m.gguf")
    assert f"ollama create swifty -f {out / 'Modelfile'}" in r.stdout
    assert f"llama-cli -m {gguf_file}" in r.stdout
    assert sorted(os.listdir(out)) == [".swiftlite-output.json", "Modelfile", "swifty-q4_k_m.gguf"]
    assert os.path.getsize(gguf_file) < 0.6 * os.path.getsize(swifty_f16)
    template = checkpoint_template(ckpt)
    got = llamacpp(tmp_path, gguf_file,
                   [{"prompt_ids": template.encode_prompt(WHO), "max_tokens": 40}])
    assert got["metadata"]["tokenizer.chat_template"] == template.to_jinja()  # as in the f16
    assert got["results"][0]["stopped"] and "Swifty" in got["results"][0]["text"]

    again = run_cli("export", "--ckpt_dir", ckpt, "--quant", "q4_k_m", "--output_dir", out,
                    env=ENV, check=False)
    assert again.returncode == 2 and "--exist_ok true" in again.stderr
    (out / "notes.txt").write_text("mine")
    again = run_cli("export", "--ckpt_dir", ckpt, "--quant", "q4_k_m", "--output_dir", out,
                    "--exist_ok", "true", env=ENV, check=False)
    assert again.returncode == 2 and "notes.txt" in again.stderr and "Traceback" not in again.stderr
    assert (out / "notes.txt").read_text() == "mine" and os.path.exists(gguf_file)


@pytest.mark.slow
@needs_llamacpp
@pytest.mark.parametrize("alias,arch", [("tiny-qwen2.5", "qwen2"), ("tiny-qwen3", "qwen3")])
def test_qwen25_and_qwen3_convert_and_answer_like_transformers(alias, arch, tmp_path):
    """Qwen2.5 and Qwen3 (their official templates, tools included) convert; llama.cpp's
    first greedy tokens are transformers'; the template and end of turn travel."""
    from swiftlite.models.builtin import build
    folder = build(alias)
    path = swiftlite.export(model=alias, quant="f16", output_dir=str(tmp_path / "out"),
                            llamacpp_venv=LLAMACPP_VENV)
    template = checkpoint_template(folder)
    prompt = template.encode_prompt([{"role": "user", "content": "Weather in Paris?"}], TOOLS)
    mine = transformers_greedy(folder, prompt, 4)
    conversation = CONVERSATIONS["tools, calls, results"][0]
    got = llamacpp(tmp_path, path, [{"prompt_ids": prompt, "max_tokens": 4}],
                   render=[{"messages": conversation, "tools": TOOLS}])
    fields = got["metadata"]
    assert fields["general.architecture"] == arch
    assert fields["tokenizer.chat_template"] == template.to_jinja()
    assert fields["tokenizer.ggml.eos_token_id"] == str(
        template.tokenizer.convert_tokens_to_ids("<|im_end|>"))
    assert got["results"][0]["tokens"][:4] == mine[:4]
    # llama-cpp-python renders the GGUF's template (tools, calls, results) as transformers
    # renders the checkpoint's (its Jinja writes JSON with sorted keys: compared as values)
    assert json_lines(got["render"][0]) == json_lines(
        template.render(conversation, add_generation_prompt=True, tools=TOOLS)[0])
    modelfile = open(os.path.join(tmp_path, "out", "Modelfile"), encoding="utf-8").read()
    assert "{{- if .Tools }}" in modelfile and "<tool_call>" in modelfile


@pytest.mark.slow
@needs_llamacpp
def test_gguf_lora_loads_with_its_base_and_answers_like_the_adapter(tiny_run, tiny_qwen2,
                                                                    tmp_path):
    """--format gguf-lora: llama.cpp's convert_lora_to_gguf; llama.cpp loads the base GGUF with
    it (--lora) and answers the adapter's greedy tokens."""
    ckpt = tiny_run.last_checkpoint
    lora = swiftlite.export(ckpt_dir=ckpt, format="gguf-lora", quant="f16",
                            output_dir=str(tmp_path / "lora"), llamacpp_venv=LLAMACPP_VENV)
    base = swiftlite.export(model=tiny_qwen2, quant="f16", output_dir=str(tmp_path / "base"),
                            llamacpp_venv=LLAMACPP_VENV)
    assert lora.endswith("-lora-f16.gguf")
    modelfile = open(os.path.join(tmp_path, "lora", "Modelfile"), encoding="utf-8").read()
    assert f"ADAPTER ./{os.path.basename(lora)}" in modelfile
    template = checkpoint_template(ckpt)
    prompt = template.encode_prompt([{"role": "user", "content": "What is 2+2?"}])
    mine = transformers_greedy(tiny_qwen2, prompt, 6, adapter=ckpt, eos=template.stop_token_ids())
    plain = transformers_greedy(tiny_qwen2, prompt, 6, eos=template.stop_token_ids())
    assert mine != plain  # the adapter changes the answer: the test can tell it was applied
    got = llamacpp(tmp_path, base, [{"prompt_ids": prompt, "max_tokens": 6}], lora=lora)
    assert got["results"][0]["tokens"][:4] == mine[:4]


# -- bad input: exit 2, nothing written, the source untouched --------------------------------------
def test_missing_llamacpp_says_how_to_install_it(tiny_qwen2, tmp_path):
    r = run_cli("export", "--model", tiny_qwen2, "--quant", "f16", "--output_dir",
                tmp_path / "o", env={"SWIFTLITE_LLAMACPP_VENV": str(tmp_path / "none")},
                check=False)
    assert r.returncode == 2 and "bash scripts/setup_llamacpp.sh" in r.stderr
    assert "Traceback" not in r.stderr and not os.path.exists(tmp_path / "o")


@needs_llamacpp
def test_refusals_leave_everything_as_it_was(tiny_qwen2, tmp_path):
    """A folder that is not an earlier export's, an architecture llama.cpp cannot convert, a
    checkpoint whose base cannot be found, a quant type llama.cpp lacks, an unknown template:
    refused, nothing written or deleted."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("keep")
    with pytest.raises(UsageError, match="replaces only a folder it wrote itself"):
        swiftlite.export(model=tiny_qwen2, quant="f16", output_dir=str(theirs), exist_ok=True,
                         llamacpp_venv=LLAMACPP_VENV)
    assert os.listdir(theirs) == ["keep.txt"]

    odd = tmp_path / "odd"
    odd.mkdir()
    for f in os.listdir(tiny_qwen2):
        if f != "config.json":
            os.symlink(os.path.join(tiny_qwen2, f), odd / f)
    config = json.load(open(os.path.join(tiny_qwen2, "config.json")))
    (odd / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchLM"]}))
    with pytest.raises(UsageError, match="NoSuchLM is not one that llama.cpp's converter"):
        swiftlite.export(model=str(odd), quant="f16", llamacpp_venv=LLAMACPP_VENV)

    lost = tmp_path / "lost"
    lost.mkdir()
    (lost / "adapter_config.json").write_text(json.dumps(
        {"base_model_name_or_path": str(tmp_path / "gone"), "peft_type": "LORA"}))
    with pytest.raises(UsageError, match="base model of .* is not available"):
        swiftlite.export(ckpt_dir=str(lost), quant="f16", llamacpp_venv=LLAMACPP_VENV)
    with pytest.raises(UsageError, match="--quant q3_k"):
        swiftlite.export(model=tiny_qwen2, quant="q3_k", llamacpp_venv=LLAMACPP_VENV)
    # the template is read while the converter runs: refused there, the converter is stopped
    with pytest.raises(UsageError, match="--template no-such-template: unknown template"):
        swiftlite.export(model=tiny_qwen2, quant="f16", template="no-such-template",
                         output_dir=str(tmp_path / "new"), llamacpp_venv=LLAMACPP_VENV)
    mine = f"llamacpp_child.py convert .*{re.escape(str(tmp_path))}"
    left = subprocess.run(["pgrep", "-f", mine], capture_output=True)
    assert left.returncode == 1, left.stdout  # no converter of this test left running
    assert sorted(os.listdir(tmp_path)) == ["lost", "odd", "theirs"]


@pytest.mark.slow  # a llama.cpp conversion: not for the inner loop
@needs_llamacpp
def test_a_disk_that_fills_during_the_write_says_so_and_leaves_nothing(tiny_qwen2, tmp_path):
    """The converter's write fails for want of space: exit 1 with a sentence, no traceback, no
    folder under the final name, no temporary folder left. The file size limit (RLIMIT_FSIZE,
    inherited by the converter) stands in for a full disk: EFBIG where a full disk gives
    ENOSPC (a full filesystem cannot be mounted here)."""
    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails, no kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    out = tmp_path / "o"
    r = subprocess.run([sys.executable, "-m", "swiftlite.cli", "export", "--model", tiny_qwen2,
                        "--quant", "f16", "--output_dir", str(out)], capture_output=True,
                       text=True, env={**os.environ, **ENV}, preexec_fn=small_files, timeout=600)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "file size limit" in r.stderr and "nothing was written under the final name" in \
        r.stderr
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


def test_web_ui_export_tab_builds_the_gguf_command(tiny_run, tmp_path):
    """The Export tab's GGUF button: format and quant become `swiftlite export` flags; it
    writes only a new <checkpoint>-gguf folder inside the output root."""
    from swiftlite.webui import form
    from swiftlite.webui.export_tab import gguf_args
    from swiftlite.webui.policy import Policy
    ckpt = tiny_run.last_checkpoint
    policy = Policy(os.path.dirname(os.path.dirname(ckpt)))
    args, target = gguf_args(ckpt, "gguf", "q8_0", policy)
    assert target == ckpt + "-gguf"
    assert form.command_argv(args) == ["--ckpt_dir", ckpt, "--quant", "q8_0"]
    with pytest.raises(UsageError, match="must be inside the output root"):
        gguf_args(ckpt, "gguf", "q8_0", Policy(str(tmp_path)))
    with pytest.raises(UsageError, match="convert_lora_to_gguf.py"):
        gguf_args(ckpt, "gguf-lora", "q4_k_m", policy)
