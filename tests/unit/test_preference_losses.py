"""swiftlite's preference losses against TRL's own code (the field's reference), on the same
per-token log-probs: every DPO loss type, CPO, SimPO, ORPO and KTO, loss and metrics to 1e-5.

TRL's trainers compute the loss inside methods that read a few attributes of the trainer and
call the model; they are called here with those attributes on a namespace and a stand-in model
that returns the chosen per-token log-probs, so what is compared is TRL's arithmetic itself."""
from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from swiftlite.config.rlhf_args import LOSS_TYPES
from swiftlite.training.preference.losses import (DISCOPOP_TAU, LossConfig, Logps, kto_loss,
                                                  paired_loss)

trl = pytest.importorskip("trl")

B, L = 6, 7  # pairs per batch, completion positions per sequence
TOL = dict(rtol=1e-5, atol=1e-5)


class _Accelerator:
    device = torch.device("cpu")

    @staticmethod
    def gather_for_metrics(x):
        return x

    gather = gather_for_metrics


def _batch(seed: int):
    """Per-token log-probs [2B, L] of chosen (first B) and rejected rows, zero outside each
    reply's mask (as TRL's fused head returns them), and reference sums."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(2 * B, L, dtype=torch.long)
    for i in range(2 * B):
        mask[i, : int(torch.randint(1, L + 1, (1,), generator=g))] = 1
    per_token = -torch.rand(2 * B, L, generator=g, dtype=torch.float64) * 2 * mask
    ref = per_token.sum(1) + torch.randn(2 * B, generator=g, dtype=torch.float64) * 0.5
    return per_token, mask, ref


def _ours(per_token, mask):
    sums, counts = per_token.sum(1), mask.sum(1)
    return Logps(sums[:B], counts[:B]), Logps(sums[B:], counts[B:])


def _trl_dpo(loss_types, weights, per_token, mask, ref, beta, ls):
    from trl import DPOTrainer
    outputs = SimpleNamespace(log_probs=per_token, entropy=torch.zeros_like(per_token),
                              mean_logits=torch.zeros_like(per_token),
                              is_top1=torch.zeros_like(mask, dtype=torch.bool))
    model = lambda **kw: outputs  # noqa: E731
    model.training = True
    fake = SimpleNamespace(model=model, accelerator=_Accelerator, aux_loss_enabled=False,
                           ld_alpha=None, precompute_ref_logps=True,
                           f_divergence_type="reverse_kl", loss_types=loss_types,
                           loss_weights=weights, beta=beta, label_smoothing=ls,
                           use_weighting=False, args=SimpleNamespace(discopop_tau=DISCOPOP_TAU),
                           _metrics=defaultdict(lambda: defaultdict(list)),
                           _total_train_tokens=0, _tp_size=1)
    # a prompt column first: TRL's masks include the prompt and are shifted by one
    full_mask = torch.cat([torch.zeros(2 * B, 1, dtype=torch.long), mask], 1)
    inputs = {"input_ids": torch.ones_like(full_mask), "attention_mask": torch.ones_like(full_mask),
              "completion_mask": full_mask, "ref_chosen_logps": ref[:B],
              "ref_rejected_logps": ref[B:]}
    loss = DPOTrainer._compute_loss(fake, model, inputs, False)
    return loss, {k: v[-1] for k, v in fake._metrics["train"].items()}


def _check_metrics(ours: dict, theirs: dict, names) -> None:
    for name in names:
        value = ours[name]
        value = value.float().mean().item() if torch.is_tensor(value) else value
        assert math.isclose(value, float(theirs[name]), rel_tol=1e-5, abs_tol=1e-5), name


REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")


@pytest.mark.parametrize("loss_type", LOSS_TYPES["dpo"])
@pytest.mark.parametrize("beta,ls", [(0.1, 0.0), (0.5, 0.2)])
def test_dpo_losses_equal_trl(loss_type, beta, ls):
    if ls == 0 and loss_type == "exo_pair":
        ls = 1e-3  # EXO's label smoothing is its epsilon, which must be positive
    per_token, mask, ref = _batch(hash((loss_type, beta)) % 1000)
    chosen, rejected = _ours(per_token, mask)
    cfg = LossConfig("dpo", loss_type, beta, ls)
    loss, metrics = paired_loss(cfg, chosen, rejected, ref[:B], ref[B:])
    theirs, their_metrics = _trl_dpo([loss_type], [1.0], per_token, mask, ref, beta, ls)
    torch.testing.assert_close(loss, theirs, **TOL)
    _check_metrics(metrics, their_metrics, REWARDS)


def test_rpo_alpha_is_trls_sft_term():
    per_token, mask, ref = _batch(7)
    chosen, rejected = _ours(per_token, mask)
    loss, _ = paired_loss(LossConfig("dpo", "sigmoid", 0.1, rpo_alpha=0.7), chosen, rejected,
                          ref[:B], ref[B:])
    theirs, _ = _trl_dpo(["sigmoid", "sft"], [1.0, 0.7], per_token, mask, ref, 0.1, 0.0)
    torch.testing.assert_close(loss, theirs, **TOL)


def test_first_sigmoid_dpo_loss_is_ln2_when_policy_is_reference():
    per_token, mask, _ = _batch(3)
    chosen, rejected = _ours(per_token, mask)
    loss, metrics = paired_loss(LossConfig(), chosen, rejected, chosen.sum, rejected.sum)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-12)
    assert metrics["rewards/margins"].abs().max().item() == 0


def _logits_batch(seed: int, vocab: int = 11):
    """Real logits and labels (-100 on the prompt and padding) for TRL's get_batch_logps."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2 * B, L + 1, vocab, generator=g, dtype=torch.float64)
    labels = torch.randint(0, vocab, (2 * B, L + 1), generator=g)
    labels[:, :2] = -100
    for i in range(2 * B):
        labels[i, int(torch.randint(3, L + 2, (1,), generator=g)):] = -100
    shifted = labels[:, 1:]
    logp = torch.log_softmax(logits[:, :-1], -1).gather(2, shifted.clamp(min=0)[..., None])[..., 0]
    mask = shifted != -100
    sums, counts = (logp * mask).sum(1), mask.sum(1)
    nll = torch.nn.functional.cross_entropy(logits[:B, :-1].reshape(-1, vocab),
                                            shifted[:B].reshape(-1))
    return logits, labels, Logps(sums[:B], counts[:B]), Logps(sums[B:], counts[B:]), nll


@pytest.mark.parametrize("rlhf_type,loss_type", [("cpo", "sigmoid"), ("cpo", "hinge"),
                                                 ("cpo", "ipo"), ("simpo", "simpo")])
def test_cpo_and_simpo_equal_trl(rlhf_type, loss_type):
    from trl.experimental.cpo import CPOTrainer
    logits, labels, chosen, rejected, nll = _logits_batch(11)
    beta, gamma, alpha, ls = 0.3, 0.8, 0.0 if rlhf_type == "simpo" else 1.0, 0.1
    average = loss_type in ("ipo", "simpo")
    all_logps = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=average)
    fake = SimpleNamespace(alpha=0.0, beta=beta, simpo_gamma=gamma, label_smoothing=ls,
                           loss_type=loss_type, cpo_alpha=alpha, accelerator=_Accelerator,
                           aux_loss_enabled=False, cpo_loss=None)
    fake.cpo_loss = lambda c, r: CPOTrainer.cpo_loss(fake, c, r)
    fake.concatenated_forward = lambda model, batch: (
        all_logps[:B], all_logps[B:], logits[:B], logits[B:], nll)
    theirs, their_metrics = CPOTrainer.get_batch_loss_metrics(fake, None, {})
    cfg = LossConfig(rlhf_type, loss_type, beta, ls, simpo_gamma=gamma, cpo_alpha=alpha)
    loss, metrics = paired_loss(cfg, chosen, rejected)
    torch.testing.assert_close(loss, theirs, **TOL)
    _check_metrics(metrics, their_metrics, REWARDS + (("nll_loss",) if alpha else ()))


def test_orpo_equals_trl():
    from trl.experimental.orpo import ORPOTrainer
    logits, labels, chosen, rejected, nll = _logits_batch(5)
    all_logps = ORPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    fake = SimpleNamespace(beta=0.25, accelerator=_Accelerator, aux_loss_enabled=False)
    fake.odds_ratio_loss = lambda c, r: ORPOTrainer.odds_ratio_loss(fake, c, r)
    fake.concatenated_forward = lambda model, batch: (
        all_logps[:B], all_logps[B:], logits[:B], logits[B:], nll)
    theirs, their_metrics = ORPOTrainer.get_batch_loss_metrics(fake, None, {})
    loss, metrics = paired_loss(LossConfig("orpo", "orpo", 0.25), chosen, rejected)
    torch.testing.assert_close(loss.double(), theirs.double(), **TOL)
    _check_metrics(metrics, their_metrics, REWARDS + ("nll_loss", "log_odds_ratio",
                                                      "log_odds_chosen"))


@pytest.mark.parametrize("loss_type", LOSS_TYPES["kto"])
def test_kto_equals_trl(loss_type):
    from trl import KTOTrainer
    g = torch.Generator().manual_seed(2)
    n = 2 * B
    mask = torch.ones(n, L, dtype=torch.long)
    per_token = -torch.rand(n, L, generator=g, dtype=torch.float64)
    labels = torch.tensor([True, False, True, True, False, False] * 2)
    ref = per_token.sum(1) + torch.randn(n, generator=g, dtype=torch.float64) * 0.3
    kl_logps = -torch.rand(n, generator=g, dtype=torch.float64) * 5
    ref_kl = kl_logps - torch.rand(n, generator=g, dtype=torch.float64)  # a positive KL
    outputs = SimpleNamespace(log_probs=per_token, entropy=torch.zeros_like(per_token),
                              mean_logits=torch.zeros_like(per_token))
    model = lambda **kw: outputs  # noqa: E731
    model.training = True
    calc_kl = loss_type == "kto"
    fake = SimpleNamespace(model=model, accelerator=_Accelerator, aux_loss_enabled=False,
                           precompute_ref_logps=True, calculate_KL=calc_kl, loss_type=loss_type,
                           beta=0.2, desirable_weight=1.3, undesirable_weight=0.7,
                           _metrics=defaultdict(lambda: defaultdict(list)),
                           _total_train_tokens=0, _tp_size=1)
    fake._compute_kl_logps = lambda m, b: kl_logps if calc_kl else None
    full = torch.cat([torch.zeros(n, 1, dtype=torch.long), mask], 1)
    batch = {"input_ids": torch.ones_like(full), "attention_mask": torch.ones_like(full),
             "completion_mask": full, "label": labels, "ref_logps": ref, "ref_KL_logps": ref_kl}
    theirs = KTOTrainer._compute_loss(fake, model, batch, False)
    their_metrics = {k: v[-1] for k, v in fake._metrics["train"].items()}
    kl = (kl_logps - ref_kl).mean().clamp(min=0) if calc_kl else torch.zeros(())
    cfg = LossConfig("kto", loss_type, 0.2, desirable_weight=1.3, undesirable_weight=0.7)
    loss, metrics = kto_loss(cfg, per_token.sum(1), ref, labels, kl)
    torch.testing.assert_close(loss, theirs, **TOL)
    assert metrics["kl"].item() == pytest.approx(float(their_metrics["kl"]), abs=1e-6)
    for kind in ("chosen", "rejected"):
        count = metrics[f"count/{kind}"].item()
        for what in ("rewards", "logps"):
            ours = metrics[f"{what}/{kind}_sum"].item() / count
            assert ours == pytest.approx(their_metrics[f"{what}/{kind}"], rel=1e-5, abs=1e-6)


def test_the_reference_is_computed_under_the_trainers_autocast():
    """Full fine-tuning over fp32 masters autocasts to the run's 16 bits, so its reference
    does too; under DeepSpeed accelerate autocasts nothing (DeepSpeed casts the model), and on
    a CPU a LoRA run's bf16 base computes without autocast. (A GPU is described, not used.)"""
    import types

    from swiftlite.runtime.hardware import Hardware
    from swiftlite.training.preference.reference import _trainer_autocast
    fp32 = torch.nn.Linear(2, 2)
    bf16 = torch.nn.Linear(2, 2).to(torch.bfloat16)
    gpu, cpu = Hardware("cuda", "A100", (8, 0)), Hardware("cpu", "cpu", None, cpu_bf16=True)
    plain, ds = types.SimpleNamespace(deepspeed=None), types.SimpleNamespace(deepspeed="zero2")
    assert _trainer_autocast(fp32, plain, "bfloat16", gpu) == torch.bfloat16
    assert _trainer_autocast(fp32, plain, "float16", gpu) == torch.float16
    assert _trainer_autocast(fp32, plain, "bfloat16", cpu) == torch.bfloat16
    assert _trainer_autocast(bf16, ds, "bfloat16", gpu) is None
    assert _trainer_autocast(bf16, plain, "bfloat16", cpu) is None
    assert _trainer_autocast(fp32, plain, "float32", gpu) is None
