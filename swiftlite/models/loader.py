"""Load a tokenizer and a causal LM from a local folder, in the dtype training needs; save a
tokenizer so that it loads as fast."""
from __future__ import annotations

import copy
import json
import os
import threading
from collections import OrderedDict

from swiftlite.errors import UsageError
from swiftlite.runtime.atomic import write_json

# One process often loads the same tokenizer again: the Python API (sft, then merge, infer,
# eval), the Web-UI, the test suite. Reading a vocabulary (transformers parses tokenizer.json,
# the tokenizers library builds its Rust backend) is the slow part of a load, so each folder's
# is read once per state of its files and shared, read-only as swiftlite uses it; every caller
# still gets a tokenizer object of its own (tests/unit/test_tokenizer_reuse.py).
_LOADED: OrderedDict = OrderedDict()
_KEEP = 4  # vocabularies held: a few models at a time (a base, its checkpoints, a comparison)
_LOADED_LOCK = threading.Lock()
# The attributes that hold the vocabulary: the Rust backend and, for the classes transformers
# builds from vocab and merges (Qwen2Tokenizer), its Python copies of them.
_VOCABULARY = ("_tokenizer", "_vocab", "_merges")
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")


def load_tokenizer(model_dir: str, trust_remote_code: bool = False, *, torch_free: bool = False):
    """The model's tokenizer. torch_free: for a process that only renders prompts (export,
    deploy's vLLM backend), a folder with a tokenizer.json is read as transformers'
    PreTrainedTokenizerFast, which does not import torch as AutoTokenizer does (it reads the
    model's configuration); the same template, tokens and special tokens for the Qwen2/Qwen3
    and SmolLM2 families (tests/unit/test_templates.py)."""
    key = None if trust_remote_code else _files_state(model_dir, torch_free)
    with _LOADED_LOCK:
        tok = _LOADED.get(key) if key else None
        if tok is not None:
            _LOADED.move_to_end(key)
    if tok is None:
        tok = _read_tokenizer(model_dir, trust_remote_code, torch_free)
        if key is None or not _shareable(tok):
            return tok
        with _LOADED_LOCK:
            _LOADED[key] = tok
            while len(_LOADED) > _KEEP:
                _LOADED.popitem(last=False)
    return _own_copy(tok)


def _files_state(model_dir: str, torch_free: bool):
    """What a load of model_dir reads, as a key: the folder and each file's name, size and
    modification time (weights aside); None for what is not a local folder."""
    real = os.path.realpath(model_dir)
    if not os.path.isdir(real):
        return None
    files = sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(real)
                   if e.is_file() and not e.name.endswith(_WEIGHTS))
    return real, tuple(files), torch_free


def _shareable(tok) -> bool:
    from tokenizers import Tokenizer
    return isinstance(getattr(tok, "_tokenizer", None), Tokenizer)


def _own_copy(tok):
    """A tokenizer over the same vocabulary whose settings (chat template, pad token, padding
    side, special tokens) are its own. The tokenizers library sets padding and truncation on the
    vocabulary for each call that asks for them, so callers taking turns do not see each other's."""
    own = copy.copy(tok)
    own.__dict__.update({k: copy.deepcopy(v) for k, v in vars(tok).items()
                         if k not in _VOCABULARY})
    return own


def _read_tokenizer(model_dir: str, trust_remote_code: bool, torch_free: bool):
    if torch_free and not trust_remote_code and os.path.exists(
            os.path.join(model_dir, "tokenizer.json")):
        from transformers import PreTrainedTokenizerFast as AutoTokenizer
    else:
        from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    if tok.eos_token is None:  # training would never teach an end; generation would not stop
        raise UsageError(f"{model_dir}: the tokenizer has no EOS token. Set \"eos_token\" in its "
                         "tokenizer_config.json (for a chat model, the end-of-turn token of its "
                         "chat template, e.g. \"<|im_end|>\").")
    if tok.pad_token is None:  # batching needs one; the EOS token is never a trained pad here
        tok.pad_token = tok.eos_token
    return tok


def save_tokenizer(tok, folder: str) -> None:
    """tok.save_pretrained(folder), with the added tokens listed in tokenizer_config.json
    (added_tokens_decoder) as the models' own files and transformers 4 have them: transformers 5
    leaves the list out, and a load without it parses all of tokenizer.json once more only to
    find them (docs/performance.md: Tokenizer loads)."""
    tok.save_pretrained(folder)
    list_added_tokens(tok, folder)


def list_added_tokens(tok, folder: str) -> None:
    """The added_tokens_decoder of tok in folder's tokenizer_config.json, if it has none."""
    path = os.path.join(folder, "tokenizer_config.json")
    added = getattr(tok, "added_tokens_decoder", None)
    if not added or not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    if "added_tokens_decoder" in config:
        return
    config["added_tokens_decoder"] = {str(i): t.__getstate__() for i, t in sorted(added.items())}
    write_json(path, config, indent=2)  # a run stopped meanwhile leaves the file transformers wrote


def torch_dtype(name: str):
    import torch
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def quantization_config(settings: dict, dtype: str):
    """transformers' BitsAndBytesConfig for the quant_bits / bnb_4bit_* values in `settings`
    (an arguments dataclass's vars, a run's args.json, InferEngine.load's overrides; None
    without quant_bits): the frozen linear layers in 4 bits (nf4/fp4, blocks of 64 with their
    scales) or 8 bits (LLM.int8), computing in `dtype`; embeddings, norms and the LM head stay
    in `dtype` (transformers' default)."""
    bits = settings.get("quant_bits")
    if bits is None:
        return None
    from transformers import BitsAndBytesConfig
    if bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    double = settings.get("bnb_4bit_use_double_quant")
    return BitsAndBytesConfig(load_in_4bit=True,
                              bnb_4bit_quant_type=settings.get("bnb_4bit_quant_type") or "nf4",
                              bnb_4bit_use_double_quant=True if double is None else double,
                              bnb_4bit_compute_dtype=torch_dtype(dtype))


def load_model(model_dir: str, dtype: str, *, trust_remote_code: bool = False,
               attn_impl: str | None = None, device_map=None, quantization=None):
    """A causal LM loaded directly in `dtype` (no fp32 copy first); `quantization`: a
    BitsAndBytesConfig (quantization_config) for a 4/8-bit frozen base."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from swiftlite.runtime.allocator import bound_onednn_caches
    bound_onednn_caches()  # before the model's first matmul
    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise UsageError(f"{model_dir} needs code shipped with the model. Read it, then pass "
                             "--trust_remote_code true if you trust it.") from None
        raise
    kwargs = {"dtype": torch_dtype(dtype), "trust_remote_code": trust_remote_code}
    if attn_impl:
        kwargs["attn_implementation"] = attn_impl
    if device_map is not None:
        kwargs["device_map"] = device_map
    if quantization is not None:
        kwargs["quantization_config"] = quantization
    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)  # None: remote code
    cast = None
    if device_map is None and model_class is not None and quantization is None and \
            not _quantized_or_zero3(config):
        cast = cast_state_dict(model_dir, kwargs["dtype"])
    if cast is None:
        return AutoModelForCausalLM.from_pretrained(model_dir, config=config, **kwargs)
    model = model_class.from_pretrained(None, config=config, state_dict=cast, **kwargs)
    # What loading from the folder sets (peft records the base model's path in adapters).
    model.name_or_path = model.config.name_or_path = model_dir
    if os.path.exists(os.path.join(model_dir, "generation_config.json")):
        from transformers import GenerationConfig
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    return model


def _quantized_or_zero3(config) -> bool:
    from transformers.integrations import is_deepspeed_zero3_enabled
    return getattr(config, "quantization_config", None) is not None or is_deepspeed_zero3_enabled()


def cast_state_dict(model_dir: str, dtype) -> dict | None:
    """The checkpoint's tensors read one at a time and cast to `dtype`, when its safetensors
    files store floating-point weights in another dtype; None otherwise (transformers loads it).

    Why: transformers memory-maps the files and casts from the mapping, so the whole file is
    resident until loading ends. An fp32 SmolLM2-135M loaded in bf16 peaked 876 MB above the
    start that way, and 364 MB (the bf16 weights and the model's buffers) read tensor by tensor
    (tests/e2e/test_allocator.py::test_model_cast_on_load_reads_one_tensor_at_a_time)."""
    import torch
    from safetensors import safe_open

    from swiftlite.models.safetensors_files import base_index, tensor_meta
    if not any(os.path.exists(os.path.join(model_dir, name))
               for name in ("model.safetensors", "model.safetensors.index.json")):
        return None
    index = base_index(model_dir)  # tensor name -> file; refuses missing or corrupt files
    stored = {kind for kind, _ in tensor_meta(index).values()}
    target = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}[dtype]
    if stored & {"F64", "F32", "F16", "BF16"} <= {target}:
        return None  # nothing to cast: transformers uses the mapped file as the weights
    out = {}
    try:
        for path in sorted(set(index.values())):
            # pread: each tensor is read into memory of its own, the file is not mapped
            with safe_open(path, framework="pt", backend="pread") as f:
                for key in f.keys():
                    t = f.get_tensor(key)
                    out[key] = t.to(dtype) if t.is_floating_point() else t
    except TypeError:  # a safetensors version without the pread backend
        return None
    return out


def is_adapter_dir(path: str) -> bool:
    return os.path.exists(os.path.join(path, "adapter_config.json"))
