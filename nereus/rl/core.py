"""The RL math of PPO and GRPO as pure tensor functions, and its public entries: the advantage estimators
(``advantage_estimator``; written in ``rl.advantages`` and ``rl.token_baseline``), the clipped policy and
value losses, entropy, loss aggregation; masked reductions (``rl.masked``) and KL estimators (``rl.kl``)
are re-exported here.

Shapes follow verl's response frame: ``[B, R]`` per response token, ``mask`` 1 on real response tokens
(0 on the padding after EOS or after the length limit). No function here knows about layouts or workers.
References: PPO — Schulman et al. 2017, "Proximal Policy Optimization Algorithms"; GAE — Schulman et al.
2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation"; GRPO — Shao et al.
2024, "DeepSeekMath"; KL estimators — Schulman 2020, "Approximating KL Divergence".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from nereus.rl.advantages import (  # noqa: F401 (re-exported: rl.core is the public entry)
    AdvantageInputs,
    gae,
    gae_estimator,
    gdpo_estimator,
    gpg_estimator,
    grpo_advantages,
    grpo_estimator,
    grpo_passk_estimator,
    grpo_vectorized_estimator,
    opo_estimator,
    reinforce_plus_plus_baseline_estimator,
    reinforce_plus_plus_estimator,
    remax_estimator,
    rloo_estimator,
    rloo_vectorized_estimator,
    token_rewards,
)
from nereus.rl.kl import KL_ESTIMATORS, kl_abs, kl_estimate, kl_k1, kl_k2, kl_k3  # noqa: F401
from nereus.rl.masked import masked_mean, masked_sum, masked_var, masked_whiten  # noqa: F401
from nereus.rl.registry import name_table
from nereus.rl.token_baseline import optimal_token_baseline_estimator, tir_optimal_token_baseline_estimator
from nereus.spec.algorithms import ADVANTAGE_ESTIMATORS, LOSS_AGG_MODES

if TYPE_CHECKING:
    from nereus.rl.policy_losses import PolicyLoss as PolicyLossFn


ADVANTAGE_ESTIMATOR_FNS = name_table(ADVANTAGE_ESTIMATORS, {
    "gae": gae_estimator, "grpo": grpo_estimator, "reinforce_plus_plus": reinforce_plus_plus_estimator,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline_estimator, "remax": remax_estimator,
    "rloo": rloo_estimator, "opo": opo_estimator, "grpo_passk": grpo_passk_estimator, "gpg": gpg_estimator,
    "rloo_vectorized": rloo_vectorized_estimator, "grpo_vectorized": grpo_vectorized_estimator,
    "optimal_token_baseline": optimal_token_baseline_estimator,
    "tir_optimal_token_baseline": tir_optimal_token_baseline_estimator, "gdpo": gdpo_estimator})


def advantage_estimator(name: str) -> Callable[[AdvantageInputs], dict[str, torch.Tensor]]:
    """The estimator registered as ``name`` (a spec's ``algorithm.adv_estimator``)."""
    if name not in ADVANTAGE_ESTIMATOR_FNS:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {list(ADVANTAGE_ESTIMATOR_FNS)}")
    return ADVANTAGE_ESTIMATOR_FNS[name]


def clipped_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip_low: float = 0.2,
                        clip_high: float | None = None,
                        clip_ratio_c: float | None = 3.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token (Schulman et al. 2017, eq. 7), as a loss to minimise:
    L = max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)) with r = exp(logp − old_logp), log r clamped to
    [−20, 20] as verl. ``clip_high`` defaults to ``clip_low`` (asymmetric "clip-higher" as DAPO when
    larger). Dual-clip (Ye et al. 2020, arXiv:1912.09729; verl's ``clip_ratio_c``, default 3): where
    A < 0 the loss is also capped at −A·c, so a token whose ratio has grown far past 1 cannot push an
    unbounded update; None turns it off. Returns the loss, where the first clip was active (verl's
    ``pg_clipfrac``), and where the dual clip was (``pg_clipfrac_lower``)."""
    clip_high = clip_low if clip_high is None else clip_high
    ratio = torch.exp((logp - old_logp).clamp(-20, 20))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    lower = torch.zeros_like(loss)
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1:
            raise ValueError(f"clip_ratio_c must exceed 1 (dual-clip bounds the ratio from above), got {clip_ratio_c}")
        cap = -adv * clip_ratio_c
        negative = adv < 0
        lower = ((loss > cap) & negative).float()
        loss = torch.where(negative, torch.minimum(loss, cap), loss)
    return loss, (clipped > unclipped).float(), lower


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       clip: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss per token (PPO as in OpenAI baselines and verl): ½·max((V − R)²,
    (V_old + clip(V − V_old, −c, c) − R)²). Returns the loss and where the clipped term was larger."""
    clipped_v = old_values + (values - old_values).clamp(-clip, clip)
    a, b = (values - returns) ** 2, (clipped_v - returns) ** 2
    return 0.5 * torch.maximum(a, b), (b > a).float()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) − Σ softmax(z)·z per position of full-vocabulary logits [..., V]."""
    z = logits.float()
    return torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)


def agg_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
             horizon: int | None = None) -> torch.Tensor:
    """One number from a [B, R] per-token loss, as verl's ``agg_loss`` (verl/trainer/ppo/core_algos.py,
    ``loss_agg_mode``) over a whole mini-batch: ``token-mean`` Σ mask·ℓ / Σ mask; ``token-sum`` Σ mask·ℓ
    (no normaliser: verl scales each data-parallel rank's sum so the reduced gradient is the global sum);
    ``seq-mean-token-sum`` mean over sequences of Σ_t mask·ℓ; ``seq-mean-token-mean`` mean over sequences
    of their token means; ``seq-mean-token-sum-norm`` mean over sequences of Σ_t mask·ℓ / ``horizon`` (the
    maximum response length, R when not given; Dr. GRPO's constant normaliser, Liu et al. 2025,
    arXiv:2503.20783). The ``seq-mean-*`` means leave fully masked rows out, as verl's (padded, packed or
    filtered batches have them); a mini-batch without a response token aggregates to 0."""
    return (loss * agg_weights(mask, mode, horizon)).sum() / max(len(mask), 1)


def agg_weights(mask: torch.Tensor, mode: str = "token-mean", horizon: int | None = None) -> torch.Tensor:
    """Per-token weights w [B, R] with Σ w·ℓ / B = ``agg_loss(ℓ, mask, mode)``. Every count in w (tokens,
    non-empty rows) is the whole mini-batch's, so every micro-batch of every replica computes its part as
    Σ w·ℓ / rows and the engine's mean over equal micro-batches equals the aggregate over the mini-batch
    under any layout (the rows of a part sum to its share; verl passes the same global counts to each
    micro-batch's ``agg_loss``: ``batch_num_tokens``, ``global_batch_size``)."""
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of {list(LOSS_AGG_MODES)}")
    rows = mask.shape[0]
    if mode == "token-mean":
        return mask * rows / mask.sum().clamp(min=1)
    if mode == "token-sum":
        return mask * rows
    # seq-mean-*: the mean over the rows with at least one response token
    per_row = rows / (mask.sum(-1) > 0).sum().clamp(min=1)
    if mode == "seq-mean-token-sum":
        return mask * per_row
    if mode == "seq-mean-token-mean":
        return mask / mask.sum(-1, keepdim=True).clamp(min=1) * per_row
    return mask / (horizon or mask.shape[-1]) * per_row


def policy_loss_fn(name: str) -> PolicyLossFn:
    """The policy loss registered as ``name`` (verl's ``get_policy_loss_fn``; ``run.policy_loss.loss_mode``):
    ``fn(logp, old_logp, adv, mask, *, loss_agg_mode, rollout_is_weights=None, **options) -> (loss, metrics)``
    with verl's actor options and metric names. The losses live in ``nereus.rl.policy_losses`` (which reads
    this module), hence the import here."""
    from nereus.rl.policy_losses import policy_loss_fn as lookup

    return lookup(name)


def __getattr__(name: str) -> object:
    """``POLICY_LOSS_FNS``, the policy-loss registry, re-exported from ``nereus.rl.policy_losses`` on first
    use (that module imports this one)."""
    if name in ("POLICY_LOSS_FNS", "PolicyLoss", "LossMatrix", "PolicyLossOptions"):
        from nereus.rl import policy_losses

        return getattr(policy_losses, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
