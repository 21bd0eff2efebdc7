"""merge-lora's check: the merged model's logits against the adapter's, in bounded memory.

Each model is run one part at a time (each decoder layer, the embeddings, the final norm
and the head): a part's weights are read from the safetensors files and cast just before
it runs, and dropped after. So the check holds one layer's weights at a time, not the
whole model in fp32 (three times, one after the other): it fits the memory the streaming
merge itself used. The adapter is applied by peft's own forward, not by the merge's
arithmetic, so the check does not share the merge's assumptions.
"""
from __future__ import annotations

import contextlib
import gc

PEFT_PREFIX = "base_model.model."


class NotStreamable(Exception):
    """A model whose weights cannot be matched to its files one part at a time (str: why)."""


def max_logit_difference(base_dir: str, ckpt_dir: str, merged_dir: str, template, samples,
                         low_dtype=None, quantization=None) -> tuple[float, float | None]:
    """Largest |logit| difference between base + adapter (fp32) and the merged model on the
    samples (lists of token ids); with low_dtype, also that of base + adapter in low_dtype
    (what 16-bit rounding alone costs, for scale); with quantization (a QLoRA checkpoint),
    instead that of the adapter on the quantized base it was trained on."""
    import torch
    batch = _batch(samples, template.tokenizer.pad_token_id or 0)
    ref = _logits(base_dir, batch, torch.float32, ckpt_dir)
    diff = _max_diff(ref, _logits(merged_dir, batch, torch.float32), batch)
    if quantization is not None:  # the quantized base is small: loaded whole
        return diff, _max_diff(ref, whole_logits(base_dir, batch, torch.float32, ckpt_dir,
                                                 quantization), batch)
    if low_dtype is None:
        return diff, None
    return diff, _max_diff(ref, _logits(base_dir, batch, low_dtype, ckpt_dir), batch)


def _logits(model_dir: str, batch, dtype, adapter_dir=None):
    """streamed_logits, or whole_logits (saying why) for a model it cannot run."""
    try:
        return streamed_logits(model_dir, batch, dtype, adapter_dir)
    except NotStreamable as e:
        from swiftlite.log import info
        info(f"checking the merge with {model_dir} whole in memory ({e})")
        return whole_logits(model_dir, batch, dtype, adapter_dir)


def _batch(samples: list[list[int]], pad_id: int):
    """(input_ids, attention_mask), padded on the right: one forward pass for all samples,
    so each part's weights are read once per model."""
    import torch
    n = max(map(len, samples))
    ids = torch.tensor([s + [pad_id] * (n - len(s)) for s in samples])
    mask = torch.tensor([[1] * len(s) + [0] * (n - len(s)) for s in samples])
    return ids, mask


def _max_diff(a, b, batch) -> float:
    real = batch[1].bool()
    return float((a[real] - b[real]).abs().max())


def _forward(model, batch):
    import torch
    with torch.no_grad():
        return model(input_ids=batch[0], attention_mask=batch[1], use_cache=False).logits.float()


def whole_logits(model_dir: str, batch, dtype, adapter_dir=None, quantization=None):
    """The logits of the model loaded whole (for what streamed_logits cannot run)."""
    from transformers import AutoModelForCausalLM

    from swiftlite.log import quiet_progress_bars
    with quiet_progress_bars():  # internal loads: their progress bars say nothing new
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                     quantization_config=quantization)
    if adapter_dir:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter_dir)
    out = _forward(model.eval(), batch)
    del model
    gc.collect()
    return out


def streamed_logits(model_dir: str, batch, dtype, adapter_dir=None):
    """The logits of the model in model_dir (with the LoRA adapter in adapter_dir, through
    peft), its weights read in dtype one part at a time."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from swiftlite.models.safetensors_files import base_index
    config = AutoConfig.from_pretrained(model_dir)
    with init_empty_weights(include_buffers=False):  # buffers (rotary tables) are computed
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    slots = _placeholders(model)
    if adapter_dir:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter_dir)
    with _streamed(model.eval(), slots, base_index(model_dir), dtype):
        out = _forward(model, batch)
    del model
    gc.collect()
    return out


def _placeholders(model) -> set[int]:
    """Give every weight of an empty (meta) model an uninitialised CPU tensor of its shape:
    memory that is reserved but never written, so never resident. peft then adds the adapter
    beside them as beside real weights (on a meta model it would put the adapter on meta
    too); the hooks swap each in for the real weights while its part runs. The ids of the
    placeholders."""
    import torch
    made = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                                     requires_grad=False)
                module._parameters[name] = made[id(p)]
    return {id(p) for p in made.values()}


def _checkpoint_key(name: str) -> str:
    """A parameter's name in the model files: peft's wrapping taken off."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def _parts(module, base: set[int], prefix: str = ""):
    """(name, module) of the parts whose weights are loaded together: each layer of a
    ModuleList, and each other module with weights of its own."""
    import torch
    for name, child in module.named_children():
        if not any(id(p) in base for p in child.parameters()):
            continue  # only the adapter's weights, loaded by peft
        full = f"{prefix}{name}"
        if isinstance(module, torch.nn.ModuleList) or any(
                id(p) in base for p in child.parameters(recurse=False)):
            yield full, child
        else:
            yield from _parts(child, base, full + ".")


@contextlib.contextmanager
def _streamed(model, base: set[int], index: dict[str, str], dtype):
    """Hooks that load each part's weights before it runs and put the placeholders back
    after."""
    embed = model.get_input_embeddings()
    embed_key = next((_checkpoint_key(f"{n}.weight") for n, m in model.named_modules()
                      if m is embed), None)
    hooks = []
    for part_name, part in _parts(model, base):
        slots = []  # (module, parameter name, its placeholder, checkpoint key)
        for sub_name, sub in part.named_modules(prefix=part_name):
            for p_name, p in sub.named_parameters(recurse=False):
                if id(p) not in base:
                    continue
                key = _checkpoint_key(f"{sub_name}.{p_name}")
                if key not in index and getattr(model.config, "tie_word_embeddings", False) \
                        and sub is model.get_output_embeddings():
                    key = embed_key  # a tied head is stored once, as the embeddings
                if key not in index:
                    raise NotStreamable(f"{key} is not in the model files")
                slots.append((sub, p_name, p, key))
        hooks.append(part.register_forward_pre_hook(_loader(slots, index, dtype)))
        hooks.append(part.register_forward_hook(_dropper(slots)))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def _loader(slots, index, dtype):
    def load(module, args):
        import torch
        from safetensors import safe_open
        for sub, p_name, _, key in slots:
            with safe_open(index[key], "pt") as f:  # closed at once: no mapping left open
                tensor = f.get_tensor(key).to(dtype)
            sub._parameters[p_name] = torch.nn.Parameter(tensor, requires_grad=False)
    return load


def _dropper(slots):
    def drop(module, args, output):
        for sub, p_name, placeholder, _ in slots:
            sub._parameters[p_name] = placeholder
    return drop
