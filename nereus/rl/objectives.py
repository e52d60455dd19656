"""PPO's objectives as pure tensor functions: the clipped policy surrogate with dual-clip, the clipped value
loss, the full-vocabulary entropy, and verl's loss aggregation (``loss_agg_mode``) with its per-token
weights. Re-exported by ``nereus.rl.core``, the public entry; the policy-loss registry
(``rl.policy_losses``) builds on them.
"""

from __future__ import annotations

import torch

from nereus.spec.algorithms import LOSS_AGG_MODES


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
