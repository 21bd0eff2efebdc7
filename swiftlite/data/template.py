"""Which template renders a model's conversations.

  --template NAME or PATH   a JSON template (shipped in swiftlite/templates/, or a file): an override
  otherwise                 the model's own chat template (model_template), when its tokenizer
                            has one; a JSON template that is proven identical renders plain
                            conversations faster
  no chat template at all   the `default` JSON template (base models)

`--template model` asks for the model's own template explicitly.
"""
from __future__ import annotations

from swiftlite.data.json_template import Template, TemplateSpec, load_spec, template_names
from swiftlite.data.model_template import OWN, ModelTemplate, chat_template_text, fingerprint
from swiftlite.data.template_base import LOSS_SCALES, ChatTemplate, TemplateRejected
from swiftlite.errors import UsageError

__all__ = ["get_template", "ChatTemplate", "Template", "TemplateSpec", "ModelTemplate",
           "TemplateRejected", "template_names", "load_spec", "OWN", "LOSS_SCALES"]


def get_template(name: str | None, tokenizer, system: str | None = None,
                 loss_scale: str = "default", enable_thinking: bool | None = None) -> ChatTemplate:
    """`swiftlite.get_template(None, tokenizer).encode(messages)`: name None (or "model") is
    the tokenizer's own chat template; a name or path is a JSON template. enable_thinking is
    the model template's thinking switch (Qwen3); None keeps the template's default."""
    if loss_scale not in LOSS_SCALES:
        raise UsageError(f"--loss_scale {loss_scale}: use one of {', '.join(LOSS_SCALES)}.")
    if enable_thinking is not None and name not in (None, OWN):
        raise UsageError(f"--enable_thinking is a switch of a model's own chat template (Qwen3); "
                         f"the JSON template {name} has none. Leave out --template or the flag.")
    if name in (None, OWN):
        source = chat_template_text(tokenizer)
        if source is not None:
            template = ModelTemplate(tokenizer, system, fast=_proven_json(source, tokenizer, system),
                                     enable_thinking=enable_thinking)
        elif name == OWN:
            raise UsageError("--template model: this model's tokenizer has no chat template. Pass "
                             "a JSON template, e.g. --template default for a base model.")
        elif enable_thinking is not None:
            raise UsageError("--enable_thinking: this model has no chat template (so no thinking "
                             "switch); leave the flag out.")
        else:
            template = Template(load_spec("default"), tokenizer, system=system)
    else:
        template = Template(load_spec(name), tokenizer, system=system)
    template.loss_scale = loss_scale
    return template


def _proven_json(source: str, tokenizer, system: str | None) -> Template | None:
    digest = fingerprint(source)
    for name in template_names():
        spec = load_spec(name)
        if digest in spec.reproduces:
            return Template(spec, tokenizer, system=system)
    return None
