"""Load a tokenizer and a causal LM from a local folder, in the dtype training needs."""
from __future__ import annotations

import os

from ..errors import UsageError


def load_tokenizer(model_dir: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    if tok.pad_token is None:  # batching needs one; the EOS token is never a trained pad here
        tok.pad_token = tok.eos_token
    return tok


def torch_dtype(name: str):
    import torch
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def load_model(model_dir: str, dtype: str, *, trust_remote_code: bool = False,
               attn_impl: str | None = None, device_map=None):
    """A causal LM loaded directly in `dtype` (no fp32 copy first)."""
    from transformers import AutoConfig, AutoModelForCausalLM
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
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, **kwargs)
    return model


def is_adapter_dir(path: str) -> bool:
    return os.path.exists(os.path.join(path, "adapter_config.json"))
