"""verl's policy losses in one registry (verl/trainer/ppo/core_algos.py, ``register_policy_loss``), each
written from its paper's formula.

Every loss is a per-token *loss-matrix* function ``matrix(logp, old_logp, adv, mask, rollout_is_weights,
options) -> LossMatrix``: the [B, R] loss to minimise (its value on masked tokens is ignored) and its
per-token metrics. Everything a row needs (GSPO's and GMPO's sequence ratios) is computed within the row,
and rows are never split across micro-batches, replicas or pipeline stages, so the matrix of a part of a
mini-batch is the part of the mini-batch's matrix. Aggregation is separate: the public entry
(``PolicyLoss.__call__``, verl's signature) aggregates with ``rl.core.agg_loss``; the training path
(``rl.losses.actor_loss``) weights the matrix of each micro-batch with the mini-batch's ``agg_weights``.
One formula serves both, under any layout.

Shapes follow verl's response frame: ``[B, R]`` per response token. ``logp`` is the policy being trained
(π_θ), ``old_logp`` the policy that sampled (π_old), ``adv`` the advantages. Options are verl's actor keys
(``PolicyLossOptions``); metrics carry verl's names and are token means over the response.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType

import torch

from nereus.rl.masked import masked_mean
from nereus.rl.objectives import agg_loss, clipped_policy_loss
from nereus.rl.policy_loss_fns import (
    cispo_matrix,
    dppo_kl_matrix,
    dppo_tv_matrix,
    dro_matrix,
    geo_mean_matrix,
    gpg_matrix,
    gspo_matrix,
    is_weighted,
    sapo_matrix,
)
from nereus.rl.policy_loss_types import CLIPFRAC, CLIPFRAC_LOWER, PPO_KL, LossMatrix, PolicyLossOptions
from nereus.rl.rollout_correction import bypass_correction
from nereus.spec.algorithms import POLICY_LOSSES

__all__ = ["POLICY_LOSS_FNS", "LossMatrix", "PolicyLoss", "PolicyLossOptions", "policy_loss_fn"]

MatrixFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None",
                     PolicyLossOptions], LossMatrix]


def vanilla_matrix(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                   rollout_is_weights: torch.Tensor | None, o: PolicyLossOptions) -> LossMatrix:
    """PPO's clipped surrogate with dual-clip (Schulman et al. 2017, arXiv:1707.06347, eq. 7; Ye et al. 2020,
    arXiv:1912.09729): ``rl.core.clipped_policy_loss``, log r clamped to ±20."""
    loss, clipped, lower = clipped_policy_loss(logp, old_logp, adv, o.low, o.high, o.clip_ratio_c)
    kl = -(logp - old_logp).clamp(-20, 20)
    return LossMatrix(is_weighted(loss, rollout_is_weights), {CLIPFRAC: clipped, PPO_KL: kl, CLIPFRAC_LOWER: lower})


def clip_cov_matrix(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                    rollout_is_weights: torch.Tensor | None, o: PolicyLossOptions) -> LossMatrix:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
    Models", arXiv:2505.22617, §4): PPO's clipped loss, except that a random ``clip_cov_ratio`` share of the
    tokens whose centred covariance (A − Ā)(log π − mean log π) lies in (``clip_cov_lb``, ``clip_cov_ub``)
    and which PPO did not already clip get no gradient. The covariance and the draw are over the batch the
    function is given (verl computes them per micro-batch the same way); the ratio is not clamped."""
    if not o.clip_cov_ratio > 0:
        raise ValueError(f"clip_cov_ratio must be above 0, got {o.clip_cov_ratio}")
    ratio = torch.exp(logp - old_logp)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - o.low, 1 + o.high)
    with torch.no_grad():
        valid = mask > 0
        cov = (adv - masked_mean(adv, mask)) * (logp - masked_mean(logp, mask))
        eligible = valid & ~(clipped > unclipped) & (cov > o.clip_cov_lb) & (cov < o.clip_cov_ub)
        candidates = torch.nonzero(eligible)
        count = max(int(o.clip_cov_ratio * float(mask.sum())), 1)
        chosen = candidates[torch.randperm(len(candidates))[:count].to(candidates.device)]
        keep = torch.ones_like(adv)
        keep[chosen[:, 0], chosen[:, 1]] = 0
    loss = torch.maximum(unclipped, clipped) * keep
    return LossMatrix(is_weighted(loss, rollout_is_weights), {CLIPFRAC: (keep == 0).float(),
                                                               PPO_KL: old_logp - logp})


def kl_cov_matrix(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                  rollout_is_weights: torch.Tensor | None, o: PolicyLossOptions) -> LossMatrix:
    """KL-Cov (Cui et al. 2025, arXiv:2505.22617, §4): the unclipped surrogate −A·r, plus ``ppo_kl_coef``·|log r|
    on the ``kl_cov_ratio`` share of tokens (at least one) with the largest centred covariance
    (A − Ā)(log π − mean log π) over the batch given. verl's ``actor/ppo_kl`` here is the mean |log r|."""
    if not o.kl_cov_ratio > 0:
        raise ValueError(f"kl_cov_ratio must be above 0, got {o.kl_cov_ratio}")
    log_ratio = logp - old_logp
    surrogate = -adv * torch.exp(log_ratio)
    with torch.no_grad():
        valid = mask > 0
        flat = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
        penalised = torch.zeros(valid.numel(), dtype=torch.bool, device=mask.device)
        if len(flat):
            a, lp = adv[valid].detach(), logp[valid].detach()
            cov = (a - a.mean()) * (lp - lp.mean())
            top = torch.topk(cov, max(1, int(len(cov) * o.kl_cov_ratio))).indices
            penalised[flat[top]] = True
        penalised = penalised.reshape(valid.shape)
    loss = torch.where(penalised, surrogate + o.ppo_kl_coef * log_ratio.abs(), surrogate)
    return LossMatrix(is_weighted(loss, rollout_is_weights), {PPO_KL: log_ratio.abs()})


def bypass_mode_matrix(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                       rollout_is_weights: torch.Tensor | None, o: PolicyLossOptions) -> LossMatrix:
    """verl's bypass mode, where ``old_logp`` *is* the rollout policy's (no recomputed π_old): the rollout
    correction (``rl.rollout_correction``: IS weights π_θ/π_rollout, rejection of tokens or sequences) is
    computed here from the current log-probs, then ``loss_type`` ``ppo_clip`` is PPO's loss on
    π_θ/π_rollout with no IS weight (the clipped ratio already is one; Yao et al. 2025, "Your Efficient RL
    Framework Secretly Brings You Off-Policy RL Training") and ``reinforce`` is −w·A·log π_θ. Rejected
    tokens leave the loss; the aggregate's counts stay the mini-batch's (verl's global batch info). Any
    ``rollout_is_weights`` passed in are ignored, as verl's."""
    weights, keep, extra = bypass_correction(logp, old_logp, mask, o)
    if o.loss_type == "ppo_clip":
        m = vanilla_matrix(logp, old_logp, adv, mask, None, o)
    elif o.loss_type == "reinforce":
        loss = -adv * logp * (1.0 if weights is None else weights)
        m = LossMatrix(loss, {PPO_KL: old_logp - logp})
    else:
        raise ValueError(f"rollout_correction.loss_type must be 'ppo_clip' or 'reinforce', got {o.loss_type!r}")
    return LossMatrix(m.loss * keep, m.metrics, metric_mask=mask * keep, extra=extra)


@dataclass(frozen=True)
class PolicyLoss:
    """One registered policy loss: its loss-matrix function and, where verl fixes it whatever the job's
    ``loss_agg_mode`` (GSPO, SAPO, GMPO), its aggregation. Calling it is verl's entry."""

    name: str
    matrix: MatrixFn
    agg_mode: str | None = None
    paper: str = field(default="", compare=False)

    def aggregation(self, loss_agg_mode: str) -> str:
        """The mode this loss aggregates with under a job's ``loss_agg_mode``."""
        return self.agg_mode or loss_agg_mode

    def __call__(self, logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *,
                 loss_agg_mode: str, rollout_is_weights: torch.Tensor | None = None,
                 **options: object) -> tuple[torch.Tensor, dict[str, float]]:
        """(the loss aggregated over the batch given, its metrics under verl's names)."""
        o = PolicyLossOptions.of(options)
        m = self.matrix(logp, old_logp, adv, mask, rollout_is_weights, o)
        loss = agg_loss(m.loss, mask, self.aggregation(loss_agg_mode), o.loss_scale_factor)
        return loss, token_metrics(m, mask)


def token_metrics(m: LossMatrix, mask: torch.Tensor) -> dict[str, float]:
    """A loss's metrics: each per-token value's mean over its tokens (``metric_mask``; ``extra``: ``mask``)."""
    with torch.no_grad():
        over = mask if m.metric_mask is None else m.metric_mask
        out = {name: float(masked_mean(v.float(), over)) for name, v in m.metrics.items()}
        out |= {name: float(masked_mean(v.float(), mask)) for name, v in m.extra.items()}
    return out


_LOSSES = (
    PolicyLoss("vanilla", vanilla_matrix, paper="PPO, arXiv:1707.06347; dual-clip arXiv:1912.09729"),
    PolicyLoss("gspo", gspo_matrix, "seq-mean-token-mean", "GSPO, arXiv:2507.18071"),
    PolicyLoss("sapo", sapo_matrix, "seq-mean-token-mean", "SAPO, arXiv:2511.20347"),
    PolicyLoss("gpg", gpg_matrix, paper="GPG, arXiv:2504.02546"),
    PolicyLoss("clip_cov", clip_cov_matrix, paper="Clip-Cov, arXiv:2505.22617"),
    PolicyLoss("kl_cov", kl_cov_matrix, paper="KL-Cov, arXiv:2505.22617"),
    PolicyLoss("geo_mean", geo_mean_matrix, "seq-mean-token-mean", "GMPO, arXiv:2507.20673"),
    PolicyLoss("cispo", cispo_matrix, paper="CISPO (MiniMax-M1), arXiv:2506.13585"),
    PolicyLoss("dppo_tv", dppo_tv_matrix, paper="DPPO, arXiv:2602.04879"),
    PolicyLoss("dppo_kl", dppo_kl_matrix, paper="DPPO, arXiv:2602.04879"),
    PolicyLoss("dro", dro_matrix, paper="DRO (verl docs/algo/dro.md)"),
    PolicyLoss("bypass_mode", bypass_mode_matrix, paper="rollout correction (verl docs/algo/rollout_corr.md)"),
)
if tuple(p.name for p in _LOSSES) != POLICY_LOSSES:
    raise RuntimeError(f"policy-loss registry {[p.name for p in _LOSSES]} does not match the spec's {POLICY_LOSSES}")

# name -> PolicyLoss, read-only, in nereus.spec.algorithms.POLICY_LOSSES's order
POLICY_LOSS_FNS: Mapping[str, PolicyLoss] = MappingProxyType({p.name: p for p in _LOSSES})

# every option a loss reads, for callers that check keys (spec readers, user code)
OPTION_NAMES = tuple(f.name for f in fields(PolicyLossOptions))


def policy_loss_fn(name: str) -> PolicyLoss:
    """The loss registered as ``name``; an unknown name is refused with the registered names."""
    if name not in POLICY_LOSS_FNS:
        raise ValueError(f"unknown policy loss {name!r}; choose one of {list(POLICY_LOSS_FNS)}")
    return POLICY_LOSS_FNS[name]
