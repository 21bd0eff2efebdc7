"""The LoRA variants, all peft's: the LoraConfig of the arguments (DoRA, rsLoRA, the init,
modules_to_save, lora_bias, target modules), LoRA+'s optimizer, and PiSSA/OLoRA adapters saved
converted for the original base.

PiSSA and OLoRA start the adapter from a decomposition of each base weight W and train on
the residual W_res = W - s B0 A0. peft's save_pretrained(path_initial_model_for_weight_conversion)
writes instead the plain LoRA adapter of rank 2r, [B | -B0] [A ; A0], which applied to the
original W gives W_res + s B A: the trained model. So every checkpoint is an ordinary adapter
of the original base (infer, merge-lora, deploy, vLLM and plain peft need nothing else). The
initial A0, B0 are kept in memory from the start; resuming reads them back from the converted
adapter (its second half) and puts the residual base exactly where that run had it, whatever
this run's own decomposition gave (a randomized SVD on another machine may differ).
"""
from __future__ import annotations

import json
import os
import tempfile
import types

from swiftlite.log import info

ADAPTER_WEIGHTS = "adapter_model.safetensors"


def lora_config(args, model):
    """peft's LoraConfig for these arguments on `model` (a transformers model)."""
    from peft import LoraConfig

    from swiftlite.errors import UsageError
    from swiftlite.models.targets import peft_target
    init = args.init_lora_weights
    # a tied embedding and LM head stay one matrix when either is trained whole: one copy
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False)) and \
        _saves_embedding_or_head(model, args.modules_to_save)
    try:
        return LoraConfig(
            r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
            target_modules=peft_target(args.target_modules), use_dora=args.use_dora,
            use_rslora=args.use_rslora, lora_bias=args.lora_bias,
            init_lora_weights=True if init == "true" else init,
            modules_to_save=list(args.modules_to_save) or None,
            ensure_weight_tying=tied, task_type="CAUSAL_LM")
    except ValueError as e:  # a combination validate does not know of
        raise UsageError(f"peft refuses this LoRA configuration: {e}") from None


def _saves_embedding_or_head(model, modules_to_save) -> bool:
    """Whether --modules_to_save trains the input embedding or the LM head (peft warns when
    asked to keep a tie that no saved module touches)."""
    from swiftlite.models.targets import saved
    ends = [model.get_input_embeddings(), model.get_output_embeddings()]
    return any(saved(name, modules_to_save or ()) for name, m in model.named_modules()
               if name and any(m is end for end in ends))


def describe(config, model=None) -> str:
    """The variants in use, for the log line of prepare_model ("" for plain LoRA); with the
    peft `model`, how many modules --modules_to_save trains whole (peft's matching of the
    entries changed in 0.22: models.targets.saved)."""
    parts = [name for name, on in (("DoRA", config.use_dora), ("rsLoRA", config.use_rslora),
                                   ("lora_bias", config.lora_bias)) if on]
    if config.init_lora_weights is not True:
        parts.append(f"init {config.init_lora_weights}")
    if config.modules_to_save:
        names = ' '.join(sorted(config.modules_to_save))
        if model is not None:
            from peft.utils import ModulesToSaveWrapper
            copies = [m for m in model.modules() if isinstance(m, ModulesToSaveWrapper)]
            names += f": {len(copies)} module{'s' if len(copies) != 1 else ''} trained whole"
            import torch
            if all(p.dtype == torch.float32 for m in copies for p in m.parameters()
                   if p.requires_grad):
                names += " in fp32"
        parts.append(f"modules_to_save {names}")
    return f" ({', '.join(parts)})" if parts else ""


def train_copies_in_fp32(model, fp32_fits: bool) -> int:
    """The trained --modules_to_save copies in fp32. peft makes them in the base's dtype (it
    upcasts only the LoRA weights); on a 16-bit base AdamW's steps on a weight near 1 are then
    below bf16's resolution, so the copies would not learn at all, and an fp16 one fails the
    loss scaler ("Attempting to unscale FP16 gradients"). `fp32_fits`: the layers around a
    copy take its fp32 output (autocast on a GPU, fp32 activations on a CPU); with bf16
    activations and no autocast they would not, so the copies stay 16-bit, said in the log.
    ZeRO-3's partitioned parameters are DeepSpeed's to cast (its optimizer keeps fp32 master
    weights). Returns how many parameters were cast."""
    import torch
    half = [p for p in model.parameters() if p.requires_grad and not hasattr(p, "ds_id")
            and p.dtype in (torch.float16, torch.bfloat16)]
    if half and not fp32_fits:
        from swiftlite.log import warn
        warn("--modules_to_save: the copies train in bf16, as the activations are (a 4-bit "
             "base or --fp32_activations false on a CPU), and AdamW's steps smaller than "
             "bf16's resolution round away; --torch_dtype float32 trains them in fp32")
        return 0
    for p in half:
        p.data = p.data.float()  # the same Parameter: a tied head and embedding stay one
    return len(half)


def reload_copies(model, adapter: str) -> None:
    """The --modules_to_save copies of a saved `adapter` loaded again into their fp32
    parameters: peft loaded them into copies in the base's dtype, rounding what training
    had changed below its resolution."""
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights
    saved = {k: v for k, v in load_peft_weights(adapter).items() if "lora_" not in k}
    set_peft_model_state_dict(model, saved)


def warn_unmergeable_bias(model, config) -> None:
    """--lora_bias on layers without a bias of their own: peft merges a lora_B bias into the
    base bias, so such an adapter cannot be merged (merge-lora, export) or served by vLLM."""
    if not config.lora_bias:
        return
    from peft.tuners.lora import LoraLayer

    from swiftlite.log import warn
    names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                    if isinstance(m, LoraLayer) and getattr(m.get_base_layer(), "bias", 1) is None})
    if names:
        warn(f"--lora_bias on layers without a bias of their own ({' '.join(names)}): peft "
             "cannot merge this adapter, so merge-lora and vLLM will not take it (serve it "
             "with --infer_backend pt), unless --target_modules names layers with a bias")


def quiet_bias_shape_warning(model, config) -> None:
    """peft checks at every save that the lora_A/lora_B tensors are 2-D (a 1-D one: ZeRO-3 or
    FSDP shards saved ungathered) and counts --lora_bias's lora_B biases among them, 1-D as every
    bias is. Its warning is dropped when what it counts is exactly this model's biases."""
    if not config.lora_bias:
        return
    import warnings
    biases = sum(1 for name, _ in model.named_parameters()
                 if ".lora_B." in name and name.endswith(".bias"))
    warnings.filterwarnings("ignore", message=rf"Adapter '[^']*': {biases} LoRA tensor\(s\) "
                                              r"have invalid shape: \S+\.lora_B\.bias:")


def mutated_init(config) -> bool:
    """A peft LoraConfig's init is PiSSA/OLoRA (config.tuner_args.MUTATED_INIT)."""
    from swiftlite.config.tuner_args import MUTATED_INIT
    return str(config.init_lora_weights).lower().startswith(MUTATED_INIT)


# -- PiSSA / OLoRA: saved converted, resumed from the conversion -------------------------------
def save_converted(model) -> None:
    """From now on `model` (a freshly initialised PiSSA/OLoRA peft model) saves its adapter
    converted for the original base, and loads such a checkpoint back for training."""
    from peft.utils import get_peft_model_state_dict
    model._initial_adapter = {k: v.detach().to("cpu", copy=True)
                              for k, v in get_peft_model_state_dict(model).items()}
    model.save_pretrained = types.MethodType(_save_converted, model)
    model.load_adapter = types.MethodType(_load_converted, model)
    info(f"--init_lora_weights {model.peft_config['default'].init_lora_weights}: checkpoints "
         "hold the adapter converted for the original base (rank "
         f"{2 * model.peft_config['default'].r}, plain LoRA)")


def _save_converted(self, save_directory, **kwargs):
    from peft import PeftModel
    from safetensors.torch import save_file
    with tempfile.TemporaryDirectory(prefix="swiftlite-initial-adapter-") as tmp:
        initial = os.path.join(tmp, "initial")
        os.makedirs(initial)
        save_file(self._initial_adapter, os.path.join(initial, ADAPTER_WEIGHTS))
        return PeftModel.save_pretrained(self, save_directory,
                                         path_initial_model_for_weight_conversion=initial,
                                         **kwargs)


def _load_converted(self, model_id, adapter_name, *args, **kwargs):
    """The Trainer's resume (and its best-model reload) load a checkpoint into "default": a
    converted one goes back to rank r on the residual base of the run that saved it."""
    from peft import PeftModel
    path = os.path.join(str(model_id), "adapter_config.json")
    config = self.peft_config.get(adapter_name)
    if config is None or not os.path.exists(path):
        return PeftModel.load_adapter(self, model_id, adapter_name, *args, **kwargs)
    with open(path, encoding="utf-8") as f:
        saved_r = json.load(f).get("r")
    if saved_r != 2 * config.r:
        return PeftModel.load_adapter(self, model_id, adapter_name, *args, **kwargs)
    _restore(self, os.path.join(str(model_id), ADAPTER_WEIGHTS), adapter_name, config.r)
    return None


def _restore(model, weights: str, adapter_name: str, r: int) -> None:
    import torch
    from peft.tuners.lora import LoraLayer
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file
    saved = load_file(weights)
    trained, initial = {}, {}
    for key, t in saved.items():
        if key.endswith("lora_A.weight"):
            trained[key], initial[key] = t[:r], t[r:]
        elif key.endswith("lora_B.weight"):
            trained[key], initial[key] = t[:, :r], -t[:, r:]
    prefix = "base_model.model."
    with torch.no_grad():
        for name, layer in model.base_model.model.named_modules():
            if not isinstance(layer, LoraLayer) or adapter_name not in layer.lora_A:
                continue
            key = f"{prefix}{name}.lora_%s.weight"
            scale = layer.scaling[adapter_name]
            ours_a, ours_b = (model._initial_adapter[key % "A"].float(),
                              model._initial_adapter[key % "B"].float())
            theirs_a, theirs_b = initial[key % "A"].float(), initial[key % "B"].float()
            if torch.equal(ours_a, theirs_a) and torch.equal(ours_b, theirs_b):
                continue
            # W_res(theirs) = W_res(ours) + s (B0 A0 (ours) - B0 A0 (theirs))
            w = layer.get_base_layer().weight
            delta = scale * (ours_b @ ours_a - theirs_b @ theirs_a)
            w.copy_((w.float() + delta).to(w.dtype))
    model._initial_adapter = {**model._initial_adapter, **initial}
    set_peft_model_state_dict(model, trained, adapter_name=adapter_name)
    info(f"{os.path.dirname(weights)}: the converted PiSSA/OLoRA adapter goes on training at "
         f"rank {r} on its residual base")


# -- LoRA+ ----------------------------------------------------------------------------------
def loraplus_optimizer(model, training_args, ratio: float):
    """peft's LoRA+ optimizer: the Trainer's optimizer class and settings (--optim,
    --learning_rate, --weight_decay), lora_B at `ratio` times the learning rate."""
    from peft.optimizers import create_loraplus_optimizer
    from transformers import Trainer
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(training_args, model)
    kwargs = dict(kwargs)
    lr = kwargs.pop("lr", training_args.learning_rate)
    info(f"--lora_plus_lr_ratio {ratio}: lora_B learns at {lr * ratio:g}, lora_A at {lr:g} "
         "(peft's LoRA+ optimizer)")
    return create_loraplus_optimizer(model, cls, lr=lr, loraplus_lr_ratio=ratio,
                                     loraplus_weight_decay=training_args.weight_decay, **kwargs)
