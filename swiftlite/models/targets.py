"""What --target_modules names: peft's all-linear shorthand, names or one regex, and a check on
the meta-device model that every named module (or the regex) matches, before any weights load."""
from __future__ import annotations

import functools
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
    """Whether peft's rule picks the module called `name`, for targets as peft_target gives
    them: a regex fully matching the name, or a list entry equal to it or to its ending after
    a dot."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def check_target_modules(model, targets) -> None:
    """A UsageError naming every --target_modules entry that matches no module of `model`
    (peft's rule for a list: a module's full name, or its ending after a dot), with the names
    there are, or a module it matches that LoRA cannot adapt (a block such as mlp). Run on the
    meta-device model (models.meta.meta_model), it reports these before any weights are loaded;
    peft itself would only after."""
    import torch
    from transformers.pytorch_utils import Conv1D

    from swiftlite.errors import UsageError
    targets = peft_target(targets)
    if is_all_linear(targets):
        return
    modules = {n: m for n, m in model.named_modules() if n}
    if isinstance(targets, str):  # a regex: peft's re.fullmatch over full module names
        try:
            re.compile(targets)
        except re.error as e:
            raise UsageError(f"--target_modules {targets}: not a valid regex ({e})") from None
        missing = [] if any(_targeted(n, targets) for n in modules) else [targets]
    else:
        missing = [t for t in targets if not any(_targeted(n, [t]) for n in modules)]
    linear = sorted({n.split(".")[-1] for n, m in modules.items()
                     if isinstance(m, torch.nn.Linear)})
    if missing:
        raise UsageError(f"--target_modules {' '.join(missing)}: no such module in this model. "
                         f"Its linear layers: {', '.join(linear)}; or all-linear.")
    nn = torch.nn  # the layer types peft's LoRA adapts
    adaptable = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention,
                 Conv1D)
    blocks = sorted(n for n, m in modules.items()
                    if _targeted(n, targets) and not isinstance(m, adaptable))
    if blocks:  # peft would refuse them once the weights had loaded
        shown = targets if isinstance(targets, str) else " ".join(targets)
        raise UsageError(f"--target_modules {shown}: {blocks[0]} "
                         f"({type(modules[blocks[0]]).__name__}) is not a layer LoRA can adapt "
                         f"(linear, embedding or convolution). Its linear layers: "
                         f"{', '.join(linear)}; or all-linear.")


def saved(module_name: str, modules_to_save) -> bool:
    """Whether peft trains a full copy of the module named `module_name` for these
    --modules_to_save entries, matched as the installed peft matches them: from peft 0.22 the
    name is an entry or ends with "." and an entry ("norm" is the final norm only); before, it
    ends with an entry, no dot needed ("norm" also named every input_layernorm)."""
    if _peft_matches_whole_names():
        return any(module_name == t or module_name.endswith("." + t) for t in modules_to_save)
    return any(module_name.endswith(t) for t in modules_to_save)


@functools.cache
def _peft_matches_whole_names() -> bool:
    from importlib.metadata import version

    from packaging.version import Version
    return Version(version("peft")).release >= (0, 22)


def check_modules_to_save(model, names) -> None:
    """A UsageError for a --modules_to_save entry that names no module (see `saved`), which
    would train nothing extra without a word."""
    keys = [n for n, _ in model.named_modules() if n]
    missing = [t for t in names if not any(saved(k, [t]) for k in keys)]
    if missing:
        from swiftlite.errors import UsageError
        raise UsageError(f"--modules_to_save {' '.join(missing)}: no such module in this model "
                         "(e.g. embed_tokens, lm_head).")


def check_target_modules_before_loading(model_dir: str, targets,
                                        trust_remote_code: bool = False,
                                        init_lora_weights: str = "true",
                                        modules_to_save=()) -> None:
    """check_target_modules on the meta-device build of model_dir's config.json, for sft to
    call before loading the weights (a minute for a 7B model). Remote-code models (their
    module names may differ from transformers' class) and architectures transformers cannot
    build from the config alone are left to peft's own check."""
    if trust_remote_code or (is_all_linear(targets) and not modules_to_save):
        return
    from swiftlite.errors import UsageError
    from swiftlite.models.meta import meta_model, read_config
    try:
        _, model = meta_model(*read_config(model_dir))
    except UsageError:
        return
    check_target_modules(model, targets)
    check_modules_to_save(model, modules_to_save)
    from swiftlite.config.tuner_args import MUTATED_INIT
    head, targets = model.get_output_embeddings(), peft_target(targets)
    if (init_lora_weights.startswith(MUTATED_INIT) and head is not None
            and head.weight is model.get_input_embeddings().weight and not is_all_linear(targets)
            and any(_targeted(n, targets) for n, m in model.named_modules() if m is head)):
        raise UsageError(f"--init_lora_weights {init_lora_weights} with LoRA on lm_head: this "
                         "model's head is tied to its input embeddings (one matrix), which the "
                         "decomposition would change as well and the saved conversion would not "
                         "restore; leave lm_head out of --target_modules, or use true/gaussian")
