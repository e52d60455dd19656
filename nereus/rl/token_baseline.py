"""The optimal token baseline (OTB; R. Li, "Optimal Token Baseline", 2025,
https://richardli.xyz/optimal-token-baseline; verl's ``optimal_token_baseline`` and its multi-turn
``tir_optimal_token_baseline``): a baseline per response token instead of one per response.

For a prompt's group of responses, with G_t the reward-to-go from token t and the "realized energy"
W_t = Σ_{j ≤ t} w_j, where w_j = 1 − 2·π(y_j) + Σ_v π(v)² is the squared norm of ∇_logits log π(y_j)
(the logit-gradient proxy of a token's gradient variance, from the forward pass alone), the baseline that
minimises the gradient's variance is B*_t = Σ_i G_t^i·W_t^i / (Σ_i W_t^i + ε) over the group's responses
present at t, and A_t = G_t − B*_t. Under truncated rollout importance sampling each w_j is scaled by ρ̄_j².
A group of one has no baseline (A = G).
"""

from __future__ import annotations

import torch

from nereus.rl.advantages import AdvantageInputs, reward_to_go, step_rewards

OTB_EPS = 1e-8  # verl's epsilon of the baseline's denominator


def realized_energy(x: AdvantageInputs) -> torch.Tensor:
    """W_t = Σ_{j ≤ t} (1 − 2·π_old(y_j) + Σ_v π_old(v)²)·ρ̄_j² over the response's tokens [B, R]."""
    if x.sum_pi_squared is None:
        raise ValueError("the optimal token baseline needs sum_pi_squared (Σ_v π(v)² per response token)")
    w = 1 - 2 * torch.exp(x.old_logp.float()) + x.sum_pi_squared.float()
    if x.rollout_is_weights is not None:
        w = w * x.rollout_is_weights.float() ** 2
    return (w * x.mask).cumsum(-1)


def group_token_baselines(returns: torch.Tensor, energy: torch.Tensor, mask: torch.Tensor, groups: torch.Tensor,
                          members: torch.Tensor, zero_tail: bool) -> torch.Tensor:
    """B*_t per token [B, T] for token-aligned rows: for each uid group among the ``members`` rows with two
    or more of them, Σ_i G·W·m / (Σ_i W·m + ε) at each position t. With ``zero_tail``, where one response
    is strictly the group's longest, its baseline past the second-longest response's end is 0 (no other
    response informs it there)."""
    baselines = torch.zeros_like(returns)
    for g in torch.unique(groups[members]):
        rows = torch.nonzero((groups == g) & members).flatten()
        if len(rows) < 2:
            continue
        m = mask[rows]
        numerator = (returns[rows] * energy[rows] * m).sum(0)
        baselines[rows] = numerator / ((energy[rows] * m).sum(0) + OTB_EPS)
        if zero_tail:
            lengths = m.sum(-1)
            longest, second = torch.sort(lengths).values[-2:].flip(0).long().tolist()
            if longest > second and int((lengths == longest).sum()) == 1:
                baselines[rows[int(torch.argmax(lengths))], second:] = 0.0
    return baselines


def _otb(x: AdvantageInputs, zero_tail: bool) -> dict[str, torch.Tensor]:
    rewards = step_rewards(x)
    mask = x.mask.to(rewards.dtype)
    returns = reward_to_go(rewards, mask)
    members = torch.ones_like(x.groups, dtype=torch.bool)
    baselines = group_token_baselines(returns, realized_energy(x), mask, x.groups, members, zero_tail)
    return {"adv": (returns - baselines) * mask, "returns": returns, "rewards": rewards}


def optimal_token_baseline_estimator(x: AdvantageInputs, zero_tail: bool = False) -> dict[str, torch.Tensor]:
    """OTB's advantages A_t = G_t − B*_t with responses aligned by token position (verl's
    ``optimal_token_baseline``, whose ``handle_zero_tail`` is off by default); the returns are G_t."""
    return _otb(x, zero_tail)


def _compact(x: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Each row's masked positions moved to the front, in order, zero-padded to the longest row."""
    out = x.new_zeros((x.shape[0], int(lengths.max()) if len(lengths) else 0))
    for i in range(x.shape[0]):
        out[i, : int(lengths[i])] = x[i, mask[i].bool()]
    return out


def tir_optimal_token_baseline_estimator(x: AdvantageInputs, zero_tail: bool = True) -> dict[str, torch.Tensor]:
    """OTB for multi-turn (tool-integrated) responses, whose mask has holes where tool output was inserted:
    each response's own tokens are aligned by their index among its masked tokens, not by column, before
    the group's baseline is taken; empty responses take no part. As verl's ``tir_optimal_token_baseline``
    the zero-tail rule is on by default. On responses without holes it differs from
    ``optimal_token_baseline`` only by that default."""
    rewards = step_rewards(x)
    mask = x.mask.to(rewards.dtype)
    returns = reward_to_go(rewards, mask)
    lengths = mask.sum(-1).long()
    width = int(lengths.max()) if len(lengths) else 0
    aligned_mask = (torch.arange(width, device=mask.device)[None, :] < lengths[:, None]).to(mask.dtype)
    aligned_returns = _compact(returns, mask, lengths)
    baselines = group_token_baselines(aligned_returns, _compact(realized_energy(x), mask, lengths), aligned_mask,
                                      x.groups, lengths > 0, zero_tail)
    aligned_adv = aligned_returns - baselines
    adv = torch.zeros_like(returns)
    for i in range(len(lengths)):
        adv[i, mask[i].bool()] = aligned_adv[i, : int(lengths[i])]
    return {"adv": adv * mask, "returns": returns, "rewards": rewards}
