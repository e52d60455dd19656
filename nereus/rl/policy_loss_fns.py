"""The loss-matrix functions of verl's sequence-level and clip-free policy losses (registered in
``rl.policy_losses``, which also holds PPO's and the covariance losses). Each takes
``(logp, old_logp, adv, mask, rollout_is_weights, options)`` and returns a ``LossMatrix``; a sequence's
quantities are computed within its row, so any split of the rows gives the same per-row values.
"""

from __future__ import annotations

import torch

from nereus.rl.policy_loss_types import CLIPFRAC, CLIPFRAC_LOWER, PPO_KL, LossMatrix, PolicyLossOptions

# verl's bound on a log-ratio before the exponential; GSPO's sequence ratio is bounded above at e^10
LOG_RATIO_BOUND = 20.0
GSPO_LOG_RATIO_MAX = 10.0


def is_weighted(loss: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    """verl applies the rollout-correction weights (π_old/π_rollout, no gradient) to the per-token loss."""
    return loss if rollout_is_weights is None else loss * rollout_is_weights


def _clamped_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    return (logp - old_logp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def gspo_matrix(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                rollout_is_weights: torch.Tensor | None, o: PolicyLossOptions) -> LossMatrix:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071, eq. 5-7 and the
    token-level GSPO-token of §4.3): the sequence ratio s_i = (π_θ(y_i)/π_old(y_i))^(1/|y_i|), the
    exponential of the mean token log-ratio, clipped as PPO's ratio. Per token
    s_i,t = sg[s_i]·π_θ(y_i,t)/sg[π_θ(y_i,t)]: its value is s_i, its gradient that of log π_θ(y_i,t) times
    s_i, so with a sequence-level advantage the gradient is the paper's. log s_i,t is bounded above at 10
    as verl's; no dual clip. Aggregated seq-mean-token-mean whatever the job's mode (verl's)."""
    log_ratio = logp - old_logp
    seq = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    log_s = (logp - logp.detach() + seq.detach().unsqueeze(-1)).clamp(max=GSPO_LOG_RATIO_MAX)
    s = torch.exp(log_s)
    unclipped = -adv * s
    clipped = -adv * s.clamp(1 - o.low, 1 + o.high)
    loss = torch.maximum(unclipped, clipped)
    return LossMatrix(is_weighted(loss, rollout_is_weights),
                      {CLIPFRAC: (clipped > unclipped).float(), PPO_KL: -log_ratio,
                       CLIPFRAC_LOWER: torch.zeros_like(loss)})


def sapo_matrix(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                rollout_is_weights: torch.Tensor | None, o: PolicyLossOptions) -> LossMatrix:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347): a smooth gate instead
    of the hard clip, f(r) = σ(τ(r − 1))·4/τ with τ = ``tau_pos`` where A > 0 and ``tau_neg`` elsewhere;
    loss −f(r)·A (its gradient at r = 1 is PPO's). Log r clamped to ±20; aggregated seq-mean-token-mean
    whatever the job's mode (verl's); no clip fractions (0)."""
    log_ratio = _clamped_log_ratio(logp, old_logp)
    ratio = torch.exp(log_ratio)
    tau = torch.where(adv > 0, torch.as_tensor(o.tau_pos, dtype=adv.dtype, device=adv.device),
                      torch.as_tensor(o.tau_neg, dtype=adv.dtype, device=adv.device))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = -gate * adv
    zero = torch.zeros_like(loss)
    return LossMatrix(is_weighted(loss, rollout_is_weights),
                      {CLIPFRAC: zero, PPO_KL: -log_ratio, CLIPFRAC_LOWER: zero})


def gpg_matrix(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
               rollout_is_weights: torch.Tensor | None, o: PolicyLossOptions) -> LossMatrix:
    """GPG (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning", arXiv:2504.02546, eq. 4): plain policy gradient −A·log π_θ, no ratio and no clip. verl
    reports no metric for it."""
    return LossMatrix(is_weighted(-logp * adv, rollout_is_weights), {})


def geo_mean_matrix(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                    rollout_is_weights: torch.Tensor | None, o: PolicyLossOptions) -> LossMatrix:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673, eq. 5): the
    geometric mean of the token ratios, each clipped in log space to [−ε_low, ε_high] on the side the
    advantage's sign makes pessimistic, ρ_i = exp(mean_t sgn(A)·min(sgn(A)·log r, sgn(A)·clip(log r))); the
    row's loss −Ā_i·ρ_i (Ā_i its mean token advantage) on each of its tokens, aggregated seq-mean-token-mean
    (verl's mean over rows). IS weights enter as their geometric mean over the row; log r is not clamped."""
    log_ratio = logp - old_logp
    sign = torch.sign(adv)
    clamped = log_ratio.clamp(-o.low, o.high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)
    n = mask.sum(-1)
    ratio = torch.exp((pessimistic * mask).sum(-1) / (n + 1e-8))
    row_adv = (adv * mask).sum(-1) / (n + 1e-8)
    row_loss = -row_adv * ratio
    if rollout_is_weights is not None:
        row_loss = row_loss * torch.exp((torch.log(rollout_is_weights + 1e-10) * mask).sum(-1) / (n + 1e-8))
    clipped = (log_ratio != clamped).float()
    return LossMatrix(row_loss.unsqueeze(-1).expand_as(mask),
                      {CLIPFRAC: clipped * (adv > 0), PPO_KL: -log_ratio, CLIPFRAC_LOWER: clipped * (adv < 0)})


def cispo_matrix(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                 rollout_is_weights: torch.Tensor | None, o: PolicyLossOptions) -> LossMatrix:
    """CISPO (MiniMax 2025, "MiniMax-M1", arXiv:2506.13585, eq. 4): clip the importance weight, not the
    update: −sg[clip(r, 1−ε_low, 1+ε_high)]·A·log π_θ, so every token keeps a gradient. Log r clamped
    to ±20."""
    log_ratio = _clamped_log_ratio(logp, old_logp)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1 - o.low, 1 + o.high)
    loss = -weight.detach() * adv * logp
    return LossMatrix(is_weighted(loss, rollout_is_weights),
                      {CLIPFRAC: (ratio != weight).float(), PPO_KL: -log_ratio,
                       CLIPFRAC_LOWER: torch.zeros_like(loss)})


def _dppo(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, valid: torch.Tensor,
          rollout_is_weights: torch.Tensor | None, o: PolicyLossOptions) -> LossMatrix:
    """DPPO's loss given its trust-region mask ``valid``: −A·sg[min(r, C)]·log π_θ on the tokens inside the
    region (truncated importance sampling in place of the dual clip, C = ``clip_ratio_c``, arXiv:2602.04879
    §5.4). ``actor/pg_clipfrac`` is the share outside, ``pg_clipfrac_lower`` the share inside truncated."""
    log_ratio = _clamped_log_ratio(logp, old_logp)
    ratio = torch.exp(log_ratio)
    cap = float("inf") if o.clip_ratio_c is None else o.clip_ratio_c
    truncated = ratio.clamp(max=cap).detach()
    inside = valid.detach().float()
    loss = -adv * truncated * logp * inside
    return LossMatrix(is_weighted(loss, rollout_is_weights),
                      {CLIPFRAC: 1.0 - inside, PPO_KL: -log_ratio, CLIPFRAC_LOWER: (ratio > cap).float() * inside})


def dppo_tv_matrix(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                   rollout_is_weights: torch.Tensor | None, o: PolicyLossOptions) -> LossMatrix:
    """DPPO-Binary-TV (arXiv:2602.04879): a token is inside the trust region when its probability moved by
    at most ε_high up (A > 0) or ε_low down (A ≤ 0): π_θ − π_old ≤ ε_high, resp. ≥ −ε_low
    (``clip_ratio_high``/``clip_ratio_low`` are these thresholds here)."""
    moved = torch.exp(logp) - torch.exp(old_logp)
    valid = torch.where(adv > 0, moved <= o.high, moved >= -o.low)
    return _dppo(logp, old_logp, adv, valid, rollout_is_weights, o)


def dppo_kl_matrix(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                   rollout_is_weights: torch.Tensor | None, o: PolicyLossOptions) -> LossMatrix:
    """DPPO-Binary-KL (arXiv:2602.04879): the KL between the Bernoulli distributions (π_old, 1 − π_old) and
    (π_θ, 1 − π_θ) of the sampled token; inside the region when it is at most ε_high (A > 0) or ε_low
    (A ≤ 0), or when the probability moved in the direction that shrinks the update."""
    p, p_old = torch.exp(logp), torch.exp(old_logp)
    binary_kl = p_old * (old_logp - logp) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
    valid = torch.where(adv > 0, (binary_kl <= o.high) | (p <= p_old), (binary_kl <= o.low) | (p >= p_old))
    return _dppo(logp, old_logp, adv, valid, rollout_is_weights, o)


def dro_matrix(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
               rollout_is_weights: torch.Tensor | None, o: PolicyLossOptions) -> LossMatrix:
    """DRO, direct reward optimisation with a quadratic proximal penalty (verl docs/algo/dro.md; Richemond
    et al. 2024, "Offline Regularised Reinforcement Learning for Large Language Models Alignment",
    arXiv:2405.19107): −(A·log π_θ − ½β(log π_θ − log π_old)²), β = ``dro_beta`` > 0."""
    if o.dro_beta is None or not o.dro_beta > 0:
        raise ValueError(f"dro needs policy_loss.dro_beta > 0, got {o.dro_beta}")
    log_ratio = logp - old_logp
    loss = -(logp * adv - 0.5 * o.dro_beta * log_ratio.square())
    return LossMatrix(is_weighted(loss, rollout_is_weights), {PPO_KL: -log_ratio})
