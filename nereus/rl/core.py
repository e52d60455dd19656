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

from nereus.spec.algorithms import ADVANTAGE_ESTIMATORS, KL_KINDS


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
    minus the mean of its prompt's group, divided by the group's standard deviation (unbiased, as the
    reference implementations), broadcast to every response token. A group of one gets advantage 0."""
    adv = torch.zeros_like(scores, dtype=torch.float32)
    for g in torch.unique(groups):
        idx = groups == g
        s = scores[idx].float()
        if len(s) < 2:
            continue
        centred = s - s.mean()
        adv[idx] = centred / (s.std() + eps) if std_normalise else centred
    return adv[:, None] * mask


def kl_k1(log_ratio: torch.Tensor) -> torch.Tensor:
    """log r: unbiased, but negative on some tokens."""
    return log_ratio


def kl_k2(log_ratio: torch.Tensor) -> torch.Tensor:
    """½(log r)²: biased, low variance, never negative."""
    return 0.5 * log_ratio**2


def kl_k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """(1/r − 1) + log r: unbiased and never negative (GRPO's KL loss, Shao et al. 2024 eq. 4); clamped to
    [−10, 10] as in verl, so one outlier token cannot dominate."""
    return (torch.exp(-log_ratio) - 1 + log_ratio).clamp(-10, 10)


def _registry(names: tuple[str, ...], functions: dict[str, Callable]) -> Mapping[str, Callable]:
    """A read-only name -> function table; every name the spec accepts must have exactly one function."""
    if set(names) != set(functions):
        raise RuntimeError(f"registry {sorted(functions)} does not match the spec's names {list(names)}")
    return MappingProxyType({name: functions[name] for name in names})


# Functions of the log-ratio log(π/π_ref), under the names spec validation accepts (nereus.spec.algorithms).
KL_ESTIMATORS = _registry(KL_KINDS, {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3})


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π‖π_ref) from samples of π (Schulman 2020) with r = π/π_ref, by the
    estimator registered as ``kind`` in ``KL_ESTIMATORS``."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {list(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[kind](logp - ref_logp)


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


def gae_estimator(x: AdvantageInputs) -> dict[str, torch.Tensor]:
    """PPO's advantages: per-token rewards (score on the last token, minus the KL penalty when one is
    set), GAE over the critic's values, advantages whitened over the batch; the returns are the critic's
    targets."""
    if x.values is None:
        raise ValueError("the gae advantage estimator needs critic values")
    kl = kl_estimate(x.old_logp, x.ref_logp, x.kl_penalty) if x.kl_coef and x.ref_logp is not None else None
    rewards = token_rewards(x.scores, x.mask, kl, x.kl_coef)
    adv, returns = gae(rewards, x.values, x.mask, x.gamma, x.lam)
    return {"adv": masked_whiten(adv, x.mask), "returns": returns, "rewards": rewards}


def grpo_estimator(x: AdvantageInputs) -> dict[str, torch.Tensor]:
    """GRPO's advantages: scores normalised within each prompt's group (no critic, no reward penalty)."""
    return {"adv": grpo_advantages(x.scores, x.groups, x.mask)}


ADVANTAGE_ESTIMATOR_FNS = _registry(ADVANTAGE_ESTIMATORS, {"gae": gae_estimator, "grpo": grpo_estimator})


def advantage_estimator(name: str) -> Callable[[AdvantageInputs], dict[str, torch.Tensor]]:
    """The estimator registered as ``name`` (a spec's ``algorithm.adv_estimator``)."""
    if name not in ADVANTAGE_ESTIMATOR_FNS:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {list(ADVANTAGE_ESTIMATOR_FNS)}")
    return ADVANTAGE_ESTIMATOR_FNS[name]


def clipped_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip_low: float = 0.2,
                        clip_high: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token (Schulman et al. 2017, eq. 7), as a loss to minimise:
    max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)) with r = exp(logp − old_logp). ``clip_high`` defaults to
    ``clip_low`` (asymmetric "clip-higher" as DAPO when larger). Returns the loss and where clipping was
    active (the clipped term was larger)."""
    clip_high = clip_low if clip_high is None else clip_high
    ratio = torch.exp(logp - old_logp)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


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
