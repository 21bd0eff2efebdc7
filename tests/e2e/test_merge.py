"""merge-lora on real tiny-qwen2 checkpoints: merged logits equal adapter logits, the merged
folder works with plain transformers, tied embeddings, sharding, dtype, and clear refusals."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from helpers.cli import run_cli

import swiftlite
from swiftlite.errors import UsageError
from swiftlite.runtime.allocator import find_tcmalloc


def _leftovers(parent: str) -> list[str]:
    return [d for d in os.listdir(parent) if ".tmp-" in d or ".old-" in d]


@pytest.fixture(scope="module")
def merged(tiny_run):
    """The CLI merge of the tiny run's last checkpoint, saved in fp32 so that the logit check
    measures the merge itself, not rounding to a 16-bit training dtype."""
    ckpt = tiny_run.last_checkpoint
    r = run_cli("merge-lora", "--ckpt_dir", ckpt, "--torch_dtype", "float32")
    return ckpt, r


@pytest.mark.slow
def test_merge_cli_logits_match_and_folder_is_complete(merged):
    ckpt, r = merged
    out = ckpt + "-merged"
    assert r.stdout.strip().splitlines()[-1] == out  # the merged folder, for scripts
    diff = float(re.search(r"max \|logit difference\| adapter vs merged: (\S+)", r.stdout).group(1))
    assert diff < 1e-4
    assert "Loading weights" not in r.stderr  # the check's internal loads show no progress bars
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "chat_template.jinja", "swiftlite.json"):
        assert os.path.exists(os.path.join(out, name)), name
    saved = json.load(open(os.path.join(out, "swiftlite.json")))
    assert saved["template"] == "model" and saved["is_chat"] is True
    assert saved["system"] is None  # no --system: the model's own template decides
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(out).apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False).startswith(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>")
    assert not _leftovers(os.path.dirname(out))
    # A second merge into the same folder is refused, and leaves nothing behind.
    r2 = run_cli("merge-lora", "--ckpt_dir", ckpt, "--verify", "false", check=False)
    assert r2.returncode == 2 and "already exists" in r2.stderr and "--exist_ok" in r2.stderr
    assert "Traceback" not in r2.stderr
    assert not _leftovers(os.path.dirname(out))


PLAIN_SCRIPT = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path, conversations = sys.argv[1], json.loads(sys.argv[2])
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path)
for messages in conversations:
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=24, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    print(json.dumps({"prompt": prompt, "answer": answer}))
assert not any(m.startswith("swiftlite") for m in sys.modules)
"""


@pytest.mark.slow
def test_merged_model_in_plain_transformers_equals_swiftlite_on_adapter(merged):
    """No swiftlite import: same prompt string and same greedy answer as the adapter, with the
    training default system prompt and with a conversation's own."""
    ckpt, _ = merged
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital?"},
         {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Italy?"}]]
    r = subprocess.run([sys.executable, "-c", PLAIN_SCRIPT, ckpt + "-merged",
                        json.dumps(conversations)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    plain = [json.loads(line) for line in r.stdout.strip().splitlines()]
    from swiftlite.inference.engine import InferEngine
    engine = InferEngine.load(ckpt, torch_dtype="float32")  # the dtype the merged model has
    assert engine.ckpt.kind == "adapter"
    for messages, got in zip(conversations, plain, strict=True):
        assert got["prompt"] == engine.template.render(messages, add_generation_prompt=True)[0]
        assert got["answer"] == engine.chat(messages, max_new_tokens=24)


@pytest.mark.slow
def test_sharded_bf16_merge(tiny_run, tmp_path, capsys):
    import torch
    from safetensors import safe_open
    out = swiftlite.merge_lora(tiny_run.last_checkpoint, str(tmp_path / "m"), max_shard_size="5MB",
                               torch_dtype="bfloat16")
    m = re.search(r"adapter vs merged: (\S+) \(bfloat16 weights; .* from fp32 by (\S+)\)",
                  capsys.readouterr().out)
    diff, rounding = float(m.group(1)), float(m.group(2))
    assert diff <= 3 * rounding + 1e-3  # bf16 rounding, not a merge error
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all(os.path.exists(os.path.join(out, f)) for f in files)
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"
    for f in files:  # our streaming writer produces files safetensors itself reads
        with safe_open(os.path.join(out, f), "pt") as st:
            for k in st.keys():
                assert st.get_tensor(k).dtype == torch.bfloat16
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    assert swiftlite.merge_lora(tiny_run.last_checkpoint, out, exist_ok=True, verify=False) == out
    assert os.path.exists(os.path.join(out, "model.safetensors"))  # replaced: one 5 GB shard
    assert not os.path.exists(os.path.join(out, "model.safetensors.index.json"))


def test_a_check_that_runs_out_of_memory_loses_no_finished_merge(tiny_run, tmp_path,
                                                                monkeypatch):
    """The merged folder is in place before the check starts: memory running out during the
    check (simulated: a MemoryError from the check, as a machine too small for it would give)
    leaves the finished merge complete and loadable, and nothing half-written beside it."""
    from swiftlite.export import verify

    def out_of_memory(*args, **kwargs):
        raise MemoryError("simulated: the check did not fit")

    monkeypatch.setattr(verify, "max_logit_difference", out_of_memory)
    out = str(tmp_path / "m")
    with pytest.raises(MemoryError):
        swiftlite.merge_lora(tiny_run.last_checkpoint, out)
    from transformers import AutoModelForCausalLM
    assert AutoModelForCausalLM.from_pretrained(out).num_parameters() > 0
    assert json.load(open(os.path.join(out, "swiftlite.json")))["template"]
    assert not _leftovers(str(tmp_path))


@pytest.mark.parametrize("targets", [["q_proj", "embed_tokens", "lm_head"], ["embed_tokens"]],
                         ids=["embed+lm_head", "embed-only"])
def test_tied_embeddings_with_lora_on_embeddings(tiny_qwen2, tmp_path, targets, capsys):
    """tiny-qwen2 ties lm_head to embed_tokens; LoRA on either must untie them when merged."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    # init_lora_weights=False: random A and B, so every delta is non-zero.
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False,
                     use_rslora=True, alpha_pattern={"q_proj": 16})
    get_peft_model(base, cfg).save_pretrained(tmp_path / "adapter")
    out = swiftlite.merge_lora(str(tmp_path / "adapter"), str(tmp_path / "merged"))
    diff = float(re.search(r"adapter vs merged: (\S+)", capsys.readouterr().out).group(1))
    assert diff < 1e-4
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["tie_word_embeddings"] is False
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not torch.equal(merged.lm_head.weight, merged.model.embed_tokens.weight)


@pytest.mark.slow
def test_refusals_leave_nothing_behind(tiny_run, tiny_qwen2, smollm2, tmp_path):
    ckpt = tiny_run.last_checkpoint
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UsageError, match="neither a LoRA checkpoint"):
        swiftlite.merge_lora(str(empty))
    with pytest.raises(UsageError, match="no such folder"):
        swiftlite.merge_lora(str(tmp_path / "nope"))
    with pytest.raises(UsageError, match="is not the base .* was trained on"):
        swiftlite.merge_lora(ckpt, str(tmp_path / "o1"), model=smollm2, verify=False)
    with pytest.raises(UsageError, match="does not match the base model"):  # shapes: never
        swiftlite.merge_lora(ckpt, str(tmp_path / "o1"), model=smollm2, verify=False,
                             allow_base_mismatch=True)
    # A corrupt (truncated) base model file.
    broken = tmp_path / "broken-base"
    shutil.copytree(tiny_qwen2, broken)
    with open(broken / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(UsageError, match="corrupt or truncated"):
        swiftlite.merge_lora(ckpt, str(tmp_path / "o2"), model=str(broken), verify=False)
    # A sharded base whose index names a file that is missing.
    (broken / "model.safetensors").unlink()
    (broken / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(UsageError, match="missing"):
        swiftlite.merge_lora(ckpt, str(tmp_path / "o3"), model=str(broken), verify=False)
    assert sorted(os.listdir(tmp_path)) == ["broken-base", "empty"]


def test_full_checkpoint_has_nothing_to_merge(tiny_qwen2, tmp_path, capsys):
    full = tmp_path / "checkpoint-8"
    shutil.copytree(tiny_qwen2, full)
    (full / "args.json").write_text(json.dumps({"train_type": "full", "template": "qwen"}))
    assert swiftlite.merge_lora(str(full)) == str(full)
    assert "nothing to merge" in capsys.readouterr().err
    assert not os.path.exists(str(full) + "-merged")


def test_dora_adapter_falls_back_to_peft_merge(tiny_qwen2, tmp_path, capsys):
    """DoRA is not merged tensor by tensor: peft's merge_and_unload does it, same checks."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_dora=True,
                                    init_lora_weights=False)).save_pretrained(tmp_path / "dora")
    out = swiftlite.merge_lora(str(tmp_path / "dora"))
    captured = capsys.readouterr()
    assert "merge_and_unload" in captured.err
    assert float(re.search(r"adapter vs merged: (\S+)", captured.out).group(1)) < 1e-4
    assert os.path.exists(os.path.join(out, "chat_template.jinja"))


VERIFY_MEMORY_SCRIPT = r"""
import json, sys
import torch
from swiftlite.data.template import get_template
from swiftlite.inference.checkpoints import describe
from swiftlite.export import verify
from swiftlite.models.loader import load_tokenizer
from swiftlite.pipelines.merge import check_samples
ckpt_dir, merged, how = sys.argv[1:]
ckpt = describe(ckpt_dir)
template = get_template(ckpt.template, load_tokenizer(ckpt.tokenizer_dir()))
batch = verify._batch(check_samples(template), 0)
logits = getattr(verify, how + "_logits")
import accelerate, peft, transformers.models.llama.modeling_llama  # code, not weights


def status(field):  # this process's memory in bytes (ru_maxrss would include the parent's)
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))


with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from now
before = status("VmRSS")
ref = logits(ckpt.base_dir, batch, torch.float32, ckpt_dir)
merged_logits = logits(merged, batch, torch.float32)
peak = status("VmHWM")
print(json.dumps({"extra": peak - before, "diff": verify._max_diff(ref, merged_logits, batch)}))
"""


@pytest.mark.slow
def test_the_merge_check_holds_one_layer_not_the_model(smollm2_cognition, smollm2_merged):
    """The check runs each model a part at a time: on SmolLM2 (538 MB in fp32, its largest
    tensor the 113 MB embedding matrix) it needs less than three copies of that tensor (the
    bf16 file's and its fp32 cast, with the logits) beyond what the process held before,
    where loading the models whole needs more than the whole fp32 model; both give the same
    logits."""
    ckpt, (merged, merge_stdout) = smollm2_cognition["Swifty"], smollm2_merged
    fp32_bytes, embedding_bytes = 4 * 134_515_008, 4 * 49152 * 576

    # Measured in the allocator merge-lora runs under (tcmalloc when the system has it):
    # glibc's heap keeps a part of what was freed that varies from run to run by more than a
    # layer, tcmalloc's peak repeats within a few MB.
    tcmalloc = find_tcmalloc()
    env = dict(os.environ, LD_PRELOAD=tcmalloc) if tcmalloc else None

    def measure(how):
        r = subprocess.run([sys.executable, "-c", VERIFY_MEMORY_SCRIPT, ckpt, merged, how],
                           capture_output=True, text=True, timeout=600, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    streamed, whole = measure("streamed"), measure("whole")
    assert streamed["extra"] < 3 * embedding_bytes < fp32_bytes < whole["extra"], (streamed,
                                                                                   whole)
    assert abs(streamed["diff"] - whole["diff"]) < 1e-3
    # The merged model is saved in the training dtype. In bf16 (CPUs with bf16 units) its
    # difference from the fp32 adapter is 16-bit rounding, of the size merge-lora prints for
    # the unmerged model in bf16; in fp32 it is float noise.
    scale = re.search(r"differs from fp32 by (\S+)\)", merge_stdout)
    bound = 2 * float(scale.group(1)) if scale else 1e-2
    assert streamed["diff"] < bound, (streamed["diff"], merge_stdout)
