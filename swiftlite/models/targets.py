"""What --target_modules names: peft's all-linear shorthand, names or one regex, and a check on
the meta-device model that every named module (or the regex) matches, before any weights load."""
from __future__ import annotations

import re

ALL_LINEAR = "all-linear"  # peft's shorthand: every linear layer except the output layer


def is_all_linear(targets) -> bool:
    """--target_modules all-linear (as a string or a one-item list)."""
    return targets == ALL_LINEAR or (not isinstance(targets, str) and list(targets) == [ALL_LINEAR])


_REGEX = re.compile(r"[*+?^$()\[\]{}|\\]")  # a character no module name has


def peft_target(targets):
    """--target_modules as peft takes it: "all-linear", one regex (a single entry holding a
    regex character: peft matches a string against whole module names), or a list of names."""
    if isinstance(targets, str) or is_all_linear(targets):
        return ALL_LINEAR if is_all_linear(targets) else targets
    targets = list(targets)
    return targets[0] if len(targets) == 1 and _REGEX.search(targets[0]) else targets


def _targeted(name: str, targets) -> bool:
    """Whether peft's --target_modules rule picks the module called `name`."""
    targets = peft_target(targets)
    if isinstance(targets, str):
        return not is_all_linear(targets) and re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def check_target_modules(model, targets) -> None:
    """A UsageError naming every --target_modules entry that matches no module of `model`
    (peft's rule for a list: a module's full name, or its ending after a dot), with the names
    there are. Run on the meta-device model (models.meta.meta_model), it reports a typo before any
    weights are loaded; peft itself would only after."""
    targets = peft_target(targets)
    if is_all_linear(targets):
        return
    names = [n for n, _ in model.named_modules() if n]
    if isinstance(targets, str):  # a regex: peft's re.fullmatch over full module names
        try:
            missing = [] if any(re.fullmatch(targets, n) for n in names) else [targets]
        except re.error as e:
            from swiftlite.errors import UsageError
            raise UsageError(f"--target_modules {targets}: not a valid regex ({e})") from None
    else:
        missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        import torch
        linear = sorted({n.split(".")[-1] for n, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear)})
        from swiftlite.errors import UsageError
        raise UsageError(f"--target_modules {' '.join(missing)}: no such module in this model. "
                         f"Its linear layers: {', '.join(linear)}; or all-linear.")


def check_target_modules_before_loading(model_dir: str, targets,
                                        trust_remote_code: bool = False,
                                        init_lora_weights: str = "true") -> None:
    """check_target_modules on the meta-device build of model_dir's config.json, for sft to
    call before loading the weights (a minute for a 7B model). Remote-code models (their
    module names may differ from transformers' class) and architectures transformers cannot
    build from the config alone are left to peft's own check."""
    if trust_remote_code or is_all_linear(targets):
        return
    from swiftlite.errors import UsageError
    from swiftlite.models.meta import meta_model, read_config
    try:
        _, model = meta_model(*read_config(model_dir))
    except UsageError:
        return
    check_target_modules(model, targets)
    from swiftlite.config.tuner_args import MUTATED_INIT
    head = model.get_output_embeddings()
    if (init_lora_weights.startswith(MUTATED_INIT) and head is not None
            and head.weight is model.get_input_embeddings().weight
            and any(name == "lm_head" or name.endswith(".lm_head")
                    for name, _ in model.named_modules() if _targeted(name, targets))):
        raise UsageError(f"--init_lora_weights {init_lora_weights} with LoRA on lm_head: this "
                         "model's head is tied to its input embeddings (one matrix), which the "
                         "decomposition would change as well and the saved conversion would not "
                         "restore; leave lm_head out of --target_modules, or use true/gaussian")
