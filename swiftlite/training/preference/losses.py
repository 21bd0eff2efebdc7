"""The preference losses (the methods and their loss types: config.rlhf_args), from
per-sequence log-probabilities, with the metrics TRL reports.

Each method's formulas and defaults are TRL 1.16's (DPOTrainer, CPOTrainer with SimPO,
ORPOTrainer, KTOTrainer); tests/unit/test_preference_losses.py checks every loss type against
TRL's own code on the same log-probs. Inputs are `Logps`: the sum of the reply's token
log-probs and its token count, per sequence; the methods that use a per-token mean (IPO in CPO,
SimPO, ORPO) take it from those two.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

DISCOPOP_TAU = 0.05  # TRL's DPOConfig.discopop_tau


@dataclass(frozen=True)
class LossConfig:
    rlhf_type: str = "dpo"
    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    rpo_alpha: float | None = None  # DPO: weight of an SFT term on the chosen reply
    simpo_gamma: float = 1.0
    cpo_alpha: float = 1.0  # CPO: weight of the SFT term (SimPO: 0)
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0


@dataclass
class Logps:
    """Per sequence: the sum of the reply's token log-probs and how many tokens it has."""
    sum: torch.Tensor
    count: torch.Tensor

    @property
    def mean(self) -> torch.Tensor:
        return self.sum / self.count.clamp(min=1)


def paired_loss(cfg: LossConfig, chosen: Logps, rejected: Logps,
                ref_chosen: torch.Tensor | None = None, ref_rejected: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) of a batch of pairs; metrics are per-pair tensors (or scalars),
    detached, named as TRL names them."""
    if cfg.rlhf_type == "dpo":
        return _dpo(cfg, chosen, rejected, ref_chosen, ref_rejected)
    if cfg.rlhf_type == "orpo":
        return _orpo(cfg, chosen, rejected)
    return _cpo(cfg, chosen, rejected)


def _nll(chosen: Logps) -> torch.Tensor:
    """The SFT loss on the chosen replies: mean negative log-prob over all their tokens."""
    return -chosen.sum.sum() / chosen.count.sum().clamp(min=1)


def _dpo(cfg, chosen: Logps, rejected: Logps, ref_c, ref_r):
    beta, ls = cfg.beta, cfg.label_smoothing
    c_ratio, r_ratio = chosen.sum - ref_c, rejected.sum - ref_r
    delta = c_ratio - r_ratio
    t = cfg.loss_type
    if t == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif t == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif t == "ipo":  # per-token averages, as TRL and the IPO authors do
        ipo = c_ratio / chosen.count.clamp(min=1) - r_ratio / rejected.count.clamp(min=1)
        losses = (ipo - 1 / (2 * beta)) ** 2
    elif t == "exo_pair":
        eps = torch.tensor(ls, device=delta.device)
        losses = (torch.sigmoid(beta * delta) * (F.logsigmoid(beta * delta) - torch.log1p(-eps))
                  + torch.sigmoid(-beta * delta) * (F.logsigmoid(-beta * delta) - torch.log(eps)))
    elif t == "nca_pair":
        cr, rr = beta * c_ratio, beta * r_ratio
        losses = -F.logsigmoid(cr) - 0.5 * F.logsigmoid(-cr) - 0.5 * F.logsigmoid(-rr)
    elif t == "robust":
        losses = (-(1 - ls) * F.logsigmoid(beta * delta) + ls * F.logsigmoid(-beta * delta)) \
            / (1 - 2 * ls)
    elif t == "bco_pair":
        losses = -F.logsigmoid(beta * c_ratio) - F.logsigmoid(-beta * r_ratio)
    elif t == "sppo_hard":
        losses = (c_ratio - 0.5 / beta) ** 2 + (r_ratio + 0.5 / beta) ** 2
    elif t in ("aot", "aot_unpaired"):
        if t == "aot":
            d = torch.sort(chosen.sum - rejected.sum, dim=0)[0] - torch.sort(ref_c - ref_r, dim=0)[0]
        else:
            d = torch.sort(c_ratio, dim=0)[0] - torch.sort(r_ratio, dim=0)[0]
        losses = -F.logsigmoid(beta * d) * (1 - ls) - F.logsigmoid(-beta * d) * ls
    elif t == "apo_zero":
        losses = 1 - torch.sigmoid(beta * c_ratio) + torch.sigmoid(beta * r_ratio)
    elif t == "apo_down":
        losses = torch.sigmoid(beta * c_ratio) + 1 - torch.sigmoid(beta * delta)
    elif t == "discopop":
        logits = beta * delta
        mix = torch.sigmoid(logits / DISCOPOP_TAU)
        losses = -F.logsigmoid(logits) * (1 - mix) + torch.exp(-logits) * mix
    elif t == "sigmoid_norm":
        d = c_ratio / chosen.count.clamp(min=1) - r_ratio / rejected.count.clamp(min=1)
        losses = -F.logsigmoid(beta * d)
    else:
        raise ValueError(f"unknown DPO loss type {t!r}")
    loss = losses.mean()
    if cfg.rpo_alpha:  # TRL 1.16: loss_type [t, "sft"] with loss_weights [1, rpo_alpha]
        loss = loss + cfg.rpo_alpha * _nll(chosen)
    c_reward, r_reward = (beta * c_ratio).detach(), (beta * r_ratio).detach()
    return loss, _reward_metrics(c_reward, r_reward, chosen.sum, rejected.sum)


def _cpo(cfg, chosen: Logps, rejected: Logps):
    """CPO (sigmoid, hinge, ipo) and SimPO (CPO's simpo loss without the SFT term)."""
    beta, ls = cfg.beta, cfg.label_smoothing
    average = cfg.loss_type in ("ipo", "simpo")
    c, r = (chosen.mean, rejected.mean) if average else (chosen.sum, rejected.sum)
    logits = c - r
    if cfg.loss_type in ("sigmoid", "simpo"):
        if cfg.loss_type == "simpo":
            logits = logits - cfg.simpo_gamma / beta
        losses = -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls
    elif cfg.loss_type == "hinge":
        losses = torch.relu(1 - beta * logits)
    elif cfg.loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown CPO loss type {cfg.loss_type!r}")
    alpha = 0.0 if cfg.rlhf_type == "simpo" else cfg.cpo_alpha
    nll = _nll(chosen) if alpha else torch.zeros((), device=logits.device)
    loss = losses.mean() + alpha * nll
    metrics = _reward_metrics((beta * c).detach(), (beta * r).detach(), c, r)
    metrics["nll_loss"] = nll.detach()
    return loss, metrics


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -ln 2."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _orpo(cfg, chosen: Logps, rejected: Logps):
    c, r = chosen.mean.float(), rejected.mean.float()
    log_odds = (c - r) - (_log1mexp(c) - _log1mexp(r))
    ratio = F.logsigmoid(log_odds)
    nll = _nll(chosen)
    loss = nll - (cfg.beta * ratio).mean()
    metrics = _reward_metrics((cfg.beta * c).detach(), (cfg.beta * r).detach(), c, r)
    metrics.update({"nll_loss": nll.detach(), "log_odds_ratio": ratio.mean().detach(),
                    "log_odds_chosen": log_odds.mean().detach()})
    return loss, metrics


def _reward_metrics(c_reward, r_reward, c_logps, r_logps) -> dict:
    return {"rewards/chosen": c_reward, "rewards/rejected": r_reward,
            "rewards/accuracies": (c_reward > r_reward).float(),
            "rewards/margins": c_reward - r_reward,
            "logps/chosen": c_logps.detach(), "logps/rejected": r_logps.detach()}


def kto_loss(cfg: LossConfig, logps: torch.Tensor, ref_logps: torch.Tensor,
             desirable: torch.Tensor, kl: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """KTO on unpaired rows: `desirable` is a bool per row; `kl` is the batch's estimate of
    KL(policy || reference) (from mismatched prompt/completion pairs, clamped at 0, detached);
    metrics are sums over each kind with their counts, as TRL averages them over all ranks."""
    beta = cfg.beta
    ratio = logps - ref_logps
    c_ratio, r_ratio = ratio[desirable], ratio[~desirable]
    if cfg.loss_type == "kto":
        c_losses = 1 - torch.sigmoid(beta * (c_ratio - kl))
        r_losses = 1 - torch.sigmoid(beta * (kl - r_ratio))
    elif cfg.loss_type == "apo_zero_unpaired":
        c_losses = 1 - torch.sigmoid(beta * c_ratio)
        r_losses = torch.sigmoid(beta * r_ratio)
    else:
        raise ValueError(f"unknown KTO loss type {cfg.loss_type!r}")
    losses = torch.cat((cfg.desirable_weight * c_losses, cfg.undesirable_weight * r_losses))
    metrics = {"kl": kl.detach(),
               "rewards/chosen_sum": (beta * c_ratio).detach().sum(),
               "rewards/rejected_sum": (beta * r_ratio).detach().sum(),
               "logps/chosen_sum": logps[desirable].detach().sum(),
               "logps/rejected_sum": logps[~desirable].detach().sum(),
               "count/chosen": desirable.sum().float(), "count/rejected": (~desirable).sum().float()}
    return losses.nanmean(), metrics
