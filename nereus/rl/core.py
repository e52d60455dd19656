"""The RL math of PPO and GRPO as pure tensor functions: masked reductions, advantages and returns, KL
estimators, the clipped policy and value losses, entropy.

Shapes follow verl's response frame: ``[B, R]`` per response token, ``mask`` 1 on real response tokens
(0 on the padding after EOS or after the length limit). No function here knows about layouts or workers.
References: PPO — Schulman et al. 2017, "Proximal Policy Optimization Algorithms"; GAE — Schulman et al.
2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation"; GRPO — Shao et al.
2024, "DeepSeekMath"; KL estimators — Schulman 2020, "Approximating KL Divergence".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from nereus.spec.algorithms import ADVANTAGE_ESTIMATORS, KL_ALIASES, KL_ESTIMATOR_NAMES, LOSS_AGG_MODES


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1 (0 when there are none)."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    n = mask.sum()
    return var * n / (n - 1) if unbiased and n > 1 else var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x − mean) / std over the masked positions; PPO implementations normalise advantages this way per
    batch (OpenAI baselines, verl). Masked positions come out 0."""
    mean = masked_mean(x, mask)
    out = (x - mean) * torch.rsqrt(masked_var(x, mask) + 1e-8)
    if not shift_mean:
        out = out + mean
    return out * mask


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16): with the TD residual
    δ_t = r_t + γ·V_{t+1} − V_t (V = 0 after the last response token), A_t = Σ_l (γλ)^l δ_{t+l};
    returns R_t = A_t + V_t are the critic's targets. Inputs and outputs are [B, R]; responses start at
    column 0 and ``mask`` is contiguous. Advantages are not whitened here (see ``masked_whiten``)."""
    width = rewards.shape[1]
    adv = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(width)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * m
        adv[:, t] = running
        next_value = values[:, t] * m
    returns = (adv + values) * mask
    return adv, returns


def grpo_advantages(scores: torch.Tensor, groups: torch.Tensor, mask: torch.Tensor, std_normalise: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages (Shao et al. 2024, §4.1.2, outcome supervision): each response's score
    minus the mean of its group, divided by the group's standard deviation (unbiased) + ``eps``, broadcast
    to every response token. ``groups`` holds each response's uid: the responses sampled together from
    one drawn prompt (a prompt drawn twice in a step is two groups). As verl's
    ``compute_grpo_outcome_advantage`` (verl/trainer/ppo/core_algos.py), a group of one has mean 0 and
    std 1, so its advantage is score / (1 + eps); ``std_normalise`` False (verl's
    ``norm_adv_by_std_in_grpo``; Dr. GRPO, Liu et al. 2025) keeps score − mean."""
    s = scores.float()
    adv = torch.empty_like(s)
    for g in torch.unique(groups):
        idx = groups == g
        members = s[idx]
        if len(members) == 1:
            mean, std = torch.tensor(0.0), torch.tensor(1.0)
        else:
            mean, std = members.mean(), members.std()
        adv[idx] = (members - mean) / (std + eps) if std_normalise else members - mean
    return adv[:, None] * mask


def kl_k1(log_ratio: torch.Tensor) -> torch.Tensor:
    """log r: unbiased, but negative on some tokens."""
    return log_ratio


def kl_k2(log_ratio: torch.Tensor) -> torch.Tensor:
    """½(log r)²: biased, low variance, never negative."""
    return 0.5 * log_ratio**2


def kl_k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """(1/r − 1) + log r: unbiased and never negative (GRPO's KL loss, Shao et al. 2024 eq. 4). As verl's
    ``low_var_kl``, log r is clamped to [−20, 20] before the exponential and the result to [−10, 10], so
    one outlier token cannot dominate."""
    lr = log_ratio.clamp(-20, 20)
    return (torch.exp(-lr) - 1 + lr).clamp(-10, 10)


def kl_abs(log_ratio: torch.Tensor) -> torch.Tensor:
    """|log r| (verl's ``abs``): biased, never negative."""
    return log_ratio.abs()


def _registry(names: tuple[str, ...], functions: dict[str, Callable]) -> Mapping[str, Callable]:
    """A read-only name -> function table; every name the spec accepts must have exactly one function."""
    if set(names) != set(functions):
        raise RuntimeError(f"registry {sorted(functions)} does not match the spec's names {list(names)}")
    return MappingProxyType({name: functions[name] for name in names})


# Functions of the log-ratio log(π/π_ref), under the canonical names of nereus.spec.algorithms.
KL_ESTIMATORS = _registry(KL_ESTIMATOR_NAMES, {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3, "abs": kl_abs})


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π‖π_ref) from samples of π (Schulman 2020) with r = π/π_ref, by the
    estimator ``kind`` names: a canonical name or a verl spelling (``kl``, ``mse``, ``low_var_kl``;
    ``nereus.spec.algorithms.KL_ALIASES``)."""
    if kind not in KL_ALIASES:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {list(KL_ALIASES)}")
    return KL_ESTIMATORS[KL_ALIASES[kind]](logp - ref_logp)


def token_rewards(scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """Per-token rewards [B, R]: the sequence score on the last response token, minus ``kl_coef``·KL on
    every token when the KL is a reward penalty (Ziegler et al. 2019; Ouyang et al. 2022, eq. 2)."""
    last = (mask.sum(1).long() - 1).clamp(min=0)
    rewards = torch.zeros_like(mask, dtype=torch.float32)
    rewards[torch.arange(len(scores)), last] = scores.float()
    rewards = rewards * mask
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl * mask
    return rewards


@dataclass(frozen=True)
class AdvantageInputs:
    """What an advantage estimator may read from one step; [B] per response, [B, R] per token."""

    scores: torch.Tensor  # [B] sequence scores (rule + reward model)
    mask: torch.Tensor  # [B, R]
    groups: torch.Tensor  # [B] index of each response's prompt (GRPO's groups)
    old_logp: torch.Tensor  # [B, R] the rollout policy's log-probs
    values: torch.Tensor | None = None  # [B, R] critic values; None without a critic
    ref_logp: torch.Tensor | None = None  # [B, R] reference log-probs when the KL is a reward penalty
    kl_penalty: str = "k1"  # KL estimator of the reward penalty
    kl_coef: float = 0.0
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std: bool = True  # GRPO: divide by the group's std (verl's norm_adv_by_std_in_grpo)


def _rewards(x: AdvantageInputs) -> torch.Tensor:
    """Per-token rewards: the score on the last token, minus the KL penalty when one is set."""
    kl = kl_estimate(x.old_logp, x.ref_logp, x.kl_penalty) if x.kl_coef and x.ref_logp is not None else None
    return token_rewards(x.scores, x.mask, kl, x.kl_coef)


def gae_estimator(x: AdvantageInputs) -> dict[str, torch.Tensor]:
    """PPO's advantages: per-token rewards (score on the last token, minus the KL penalty when one is
    set), GAE over the critic's values, advantages whitened over the batch; the returns are the critic's
    targets."""
    if x.values is None:
        raise ValueError("the gae advantage estimator needs critic values")
    rewards = _rewards(x)
    adv, returns = gae(rewards, x.values, x.mask, x.gamma, x.lam)
    return {"adv": masked_whiten(adv, x.mask), "returns": returns, "rewards": rewards}


def grpo_estimator(x: AdvantageInputs) -> dict[str, torch.Tensor]:
    """GRPO's advantages: each response's summed token rewards (its score, minus the KL penalty when one
    is in the reward, as verl sums ``token_level_rewards``) normalised within its uid group. The returns are
    the advantages themselves, as verl's ``compute_grpo_outcome_advantage`` returns them (no critic)."""
    rewards = _rewards(x)
    adv = grpo_advantages(rewards.sum(-1), x.groups, x.mask, x.norm_adv_by_std)
    return {"adv": adv, "returns": adv, "rewards": rewards}


ADVANTAGE_ESTIMATOR_FNS = _registry(ADVANTAGE_ESTIMATORS, {"gae": gae_estimator, "grpo": grpo_estimator})


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
    ``loss_agg_mode``) over a whole mini-batch: ``token-mean`` Σ mask·ℓ / Σ mask; ``seq-mean-token-sum``
    mean over sequences of Σ_t mask·ℓ; ``seq-mean-token-mean`` mean over sequences of their token means;
    ``seq-mean-token-sum-norm`` mean over sequences of Σ_t mask·ℓ / ``horizon`` (the maximum response
    length, R when not given; Dr. GRPO's constant normaliser, Liu et al. 2025)."""
    return (loss * agg_weights(mask, mode, horizon)).sum() / max(len(mask), 1)


def agg_weights(mask: torch.Tensor, mode: str = "token-mean", horizon: int | None = None) -> torch.Tensor:
    """Per-token weights w [B, R] with Σ w·ℓ / B = ``agg_loss(ℓ, mask, mode)``. A per-row form lets
    every micro-batch of every replica compute its part as Σ w·ℓ / rows: the engine's mean over equal
    micro-batches then equals the aggregate over the whole mini-batch under any layout."""
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of {list(LOSS_AGG_MODES)}")
    rows = mask.shape[0]
    if mode == "token-mean":
        return mask * rows / mask.sum().clamp(min=1)
    if mode == "seq-mean-token-sum":
        return mask.clone()
    if mode == "seq-mean-token-mean":
        return mask / mask.sum(-1, keepdim=True).clamp(min=1)
    return mask / (horizon or mask.shape[-1])
