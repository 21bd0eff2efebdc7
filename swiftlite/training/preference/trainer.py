"""The Hugging Face Trainer for preference training: the loss of training.preference.losses on
log-probs from training.preference.logps, the reference as the same model with its LoRA
adapters switched off (no second copy of the weights) or precomputed once, and TRL's metrics
(rewards/chosen, rewards/margins, ...) in the logs, on train and eval."""
from __future__ import annotations

import contextlib
from collections import defaultdict

import torch

from swiftlite.training.preference.collator import PreferenceCollator
from swiftlite.training.preference.logps import sequence_logps
from swiftlite.config.rlhf_args import NEEDS_REFERENCE
from swiftlite.training.preference.losses import LossConfig, Logps, kto_loss, paired_loss


@contextlib.contextmanager
def reference_model(model):
    """The reference: `model` (peft) with its adapters switched off, and its input embeddings
    in eval mode: --neftune_noise_alpha's noise is the policy's in training, not the reference's."""
    if not hasattr(model, "disable_adapter"):
        raise RuntimeError("the reference of a model without adapters must be precomputed")
    embeddings = model.get_input_embeddings()
    was_training = embeddings.training
    embeddings.eval()
    try:
        with torch.no_grad(), model.disable_adapter():
            yield
    finally:
        embeddings.train(was_training)


def _sub_batch(inputs: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in inputs.items() if k.startswith(prefix)}


def preference_trainer_class():
    from swiftlite.training.trainer import trainer_class

    class PreferenceTrainer(trainer_class(chunked_loss=False)):
        loss_config: LossConfig = LossConfig()

        def __init__(self, *a, loss_config: LossConfig, **kw):
            super().__init__(*a, **kw)
            self.loss_config = loss_config
            # the loss is a mean over this micro-batch's pairs: the Trainer divides it by the
            # accumulation steps (it would not for a model that takes num_items_in_batch)
            self.model_accepts_loss_kwargs = False
            self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}

        def _reference_logps(self, model, inputs: dict, n: int) -> torch.Tensor:
            with reference_model(self.accelerator.unwrap_model(model)):
                return sequence_logps(model, inputs, n)[0]

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            cfg = self.loss_config
            mode = "train" if model.training else "eval"
            n = inputs["num_sequences"]
            sums, counts = sequence_logps(model, inputs, n)
            if cfg.rlhf_type == "kto":
                loss, metrics = self._kto(model, inputs, sums)
            else:
                half = n // 2
                chosen, rejected = Logps(sums[:half], counts[:half]), Logps(sums[half:], counts[half:])
                ref_c = ref_r = None
                if cfg.rlhf_type in NEEDS_REFERENCE:
                    if "ref_chosen_logps" in inputs:
                        ref_c, ref_r = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
                    else:
                        ref = self._reference_logps(model, inputs, n)
                        ref_c, ref_r = ref[:half], ref[half:]
                loss, metrics = paired_loss(cfg, chosen, rejected, ref_c, ref_r)
            self._record(mode, metrics)
            return (loss, None) if return_outputs else loss

        def _kto(self, model, inputs: dict, logps: torch.Tensor):
            """KTO: the KL estimate from the mismatched (kl_) sequences, as TRL computes it."""
            n, kl_inputs = inputs["num_sequences"], _sub_batch(inputs, "kl_")
            with torch.no_grad():
                kl_logps = sequence_logps(model, kl_inputs, n)[0]
            ref = self._reference_logps(model, inputs, n)
            ref_kl = self._reference_logps(model, kl_inputs, n)
            kl = self.accelerator.gather_for_metrics((kl_logps - ref_kl).mean().detach())
            kl = kl.mean().clamp(min=0)
            return kto_loss(self.loss_config, logps, ref, inputs["label"], kl)

        def _record(self, mode: str, metrics: dict) -> None:
            gather = self.accelerator.gather_for_metrics
            if "count/chosen" in metrics:  # KTO: averages over the rows of each kind
                for kind in ("chosen", "rejected"):
                    count = gather(metrics[f"count/{kind}"].reshape(1)).sum().item()
                    if count:
                        for what in ("rewards", "logps"):
                            total = gather(metrics[f"{what}/{kind}_sum"].reshape(1)).sum().item()
                            self._metrics[mode][f"{what}/{kind}"].append(total / count)
                m = self._metrics[mode]
                if m["rewards/chosen"] and m["rewards/rejected"]:
                    m["rewards/margins"].append(m["rewards/chosen"][-1] - m["rewards/rejected"][-1])
                self._metrics[mode]["kl"].append(metrics["kl"].item())
                return
            for name, value in metrics.items():
                value = value.detach().float().reshape(-1)
                self._metrics[mode][name].append(gather(value).mean().item())

        def log(self, logs: dict, start_time: float | None = None) -> None:
            mode = "train" if self.model.training else "eval"
            prefix = "eval_" if mode == "eval" else ""
            for name, values in self._metrics[mode].items():
                if values:
                    logs[prefix + name] = round(sum(values) / len(values), 6)
            self._metrics[mode].clear()
            super().log(logs, start_time)

        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            inputs = self._prepare_inputs(inputs)
            with torch.no_grad():
                loss = self.compute_loss(model, inputs)
            return loss.detach(), None, None

    return PreferenceTrainer


def precompute_reference(model, dataset, collator: PreferenceCollator, batch_size: int,
                         device, use_adapters: bool, autocast=None):
    """The reference log-probs of every pair of `dataset` (chosen, rejected), computed once in
    eval mode: with the adapters switched off, or on (`use_adapters`: a run that continues an
    SFT adapter, whose reference is that adapter as it starts). `autocast`: the dtype the
    Trainer autocasts to, or None."""
    from torch.utils.data import DataLoader
    rows = dataset.remove_columns([c for c in ("length",) if c in dataset.column_names])
    loader = DataLoader(rows, batch_size=batch_size, collate_fn=collator, shuffle=False)
    chosen, rejected = [], []
    was_training = model.training
    model.eval()
    try:
        for batch in loader:
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            with torch.no_grad(), (contextlib.nullcontext() if use_adapters
                                   else reference_model(model)), torch.autocast(
                    torch.device(device).type, autocast, enabled=autocast is not None):
                sums = sequence_logps(model, batch, batch["num_sequences"])[0].float().cpu()
            half = batch["num_sequences"] // 2
            chosen += sums[:half].tolist()
            rejected += sums[half:].tolist()
    finally:
        model.train(was_training)
    return chosen, rejected
