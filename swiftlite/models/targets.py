"""What --target_modules names: peft's all-linear shorthand, and a check on the meta-device
model that every named module exists, before any weights load."""
from __future__ import annotations

ALL_LINEAR = "all-linear"  # peft's shorthand: every linear layer except the output layer


def is_all_linear(targets) -> bool:
    """--target_modules all-linear (as a string or a one-item list)."""
    return targets == ALL_LINEAR or (not isinstance(targets, str) and list(targets) == [ALL_LINEAR])


def check_target_modules(model, targets) -> None:
    """A UsageError naming every --target_modules entry that matches no module of `model`
    (peft's rule for a list: a module's full name, or its ending after a dot), with the names
    there are. Run on the meta-device model (models.meta.meta_model), it reports a typo before any
    weights are loaded; peft itself would only after."""
    if isinstance(targets, str) or is_all_linear(targets):
        return  # a single string is a regex to peft: left to peft
    names = [n for n, _ in model.named_modules() if n]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        import torch
        linear = sorted({n.split(".")[-1] for n, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear)})
        from swiftlite.errors import UsageError
        raise UsageError(f"--target_modules {' '.join(missing)}: no such module in this model. "
                         f"Its linear layers: {', '.join(linear)}; or all-linear.")


def check_target_modules_before_loading(model_dir: str, targets,
                                        trust_remote_code: bool = False) -> None:
    """check_target_modules on the meta-device build of model_dir's config.json, for sft to
    call before loading the weights (a minute for a 7B model). Remote-code models (their
    module names may differ from transformers' class) and architectures transformers cannot
    build from the config alone are left to peft's own check."""
    if trust_remote_code or isinstance(targets, str) or is_all_linear(targets):
        return
    from swiftlite.errors import UsageError
    from swiftlite.models.meta import meta_model, read_config
    try:
        _, model = meta_model(*read_config(model_dir))
    except UsageError:
        return
    check_target_modules(model, targets)
