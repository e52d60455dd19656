"""Advantage estimators: what each response token's update is weighted by, from one step's scores.

Every estimator is a pure function ``AdvantageInputs -> {"adv", "returns", "rewards"}`` of verl's
response frame (``[B, R]`` per token, ``mask`` 1 on real response tokens), registered under verl's name
(``algorithm.adv_estimator``; the table is ``nereus.rl.core.ADVANTAGE_ESTIMATOR_FNS``). Each follows its
paper's formula and the corner cases of verl's ``verl/trainer/ppo/core_algos.py``, so the numbers agree
with verl's on the same inputs: a group of one has mean 0 and standard deviation 1, standard deviations
are unbiased, the small constants are verl's (1e-6 in a group's normaliser, 1e-8 under a square root).
The outcome-only estimators read the response's summed token rewards (its score, minus the KL penalty when
the KL is in the reward) and broadcast one number to every token; the per-token baselines of the optimal
token baseline live in ``nereus.rl.token_baseline``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from nereus.rl.kl import kl_estimate
from nereus.rl.masked import masked_whiten

GROUP_EPS = 1e-6  # verl's ``epsilon`` of the group-normalised estimators


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
    # ReMax: the score of the greedy response to each row's prompt (verl's reward_baselines) [B]
    baseline_scores: torch.Tensor | None = None
    # optimal token baseline: Σ_v π_old(v)² at every response token (verl's sum_pi_squared) [B, R]
    sum_pi_squared: torch.Tensor | None = None
    # optimal token baseline: truncated importance weights of the rollout (verl's rollout_is_weights) [B, R]
    rollout_is_weights: torch.Tensor | None = None
    # GDPO: each reward component's score [B] by name (verl's algorithm.gdpo_reward_keys), and its weight
    # (verl's gdpo_reward_weights; 1 for a component not named); None: the summed token rewards alone
    score_components: Mapping[str, torch.Tensor] | None = None
    score_weights: Mapping[str, float] | None = None


def token_rewards(scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """Per-token rewards [B, R]: the sequence score on the last response token, minus ``kl_coef``·KL on
    every token when the KL is a reward penalty (Ziegler et al. 2019; Ouyang et al. 2022, eq. 2). The last
    token is the last masked column, so a multi-turn mask with holes is scored at its end too."""
    last = (mask * torch.arange(1, mask.shape[1] + 1, device=mask.device)).argmax(1)
    rewards = torch.zeros_like(mask, dtype=torch.float32)
    rewards[torch.arange(len(scores)), last] = scores.float()
    rewards = rewards * mask
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl * mask
    return rewards


def step_rewards(x: AdvantageInputs) -> torch.Tensor:
    """Per-token rewards: the score on the last token, minus the KL penalty when one is set (verl's
    ``token_level_rewards``)."""
    kl = kl_estimate(x.old_logp, x.ref_logp, x.kl_penalty) if x.kl_coef and x.ref_logp is not None else None
    return token_rewards(x.scores, x.mask, kl, x.kl_coef)


def reward_to_go(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """G_t = Σ_{l ≥ t} r_l over the response's tokens (undiscounted return from each token)."""
    return (rewards * mask).flip(-1).cumsum(-1).flip(-1)


def group_rows(groups: torch.Tensor) -> Iterator[torch.Tensor]:
    """The row indices of each uid group, in the order of the uids."""
    for g in torch.unique(groups):
        yield torch.nonzero(groups == g).flatten()


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, arXiv:1506.02438, eq. 16): with the TD
    residual δ_t = r_t + γ·V_{t+1} − V_t (V = 0 after the last response token), A_t = Σ_l (γλ)^l δ_{t+l};
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
                    eps: float = GROUP_EPS) -> torch.Tensor:
    """Group-relative advantages (Shao et al. 2024, arXiv:2402.03300, §4.1.2, outcome supervision): each
    response's score minus the mean of its group, divided by the group's standard deviation (unbiased) +
    ``eps``, broadcast to every response token. ``groups`` holds each response's uid: the responses
    sampled together from one drawn prompt (a prompt drawn twice in a step is two groups). As verl's
    ``compute_grpo_outcome_advantage``, a group of one has mean 0 and std 1, so its advantage is
    score / (1 + eps); ``std_normalise`` False (verl's ``norm_adv_by_std_in_grpo``; Dr. GRPO, Liu et al.
    2025, arXiv:2503.20783) keeps score − mean."""
    s = scores.float()
    adv = torch.empty_like(s)
    for rows in group_rows(groups):
        members = s[rows]
        if len(members) == 1:
            mean, std = torch.tensor(0.0), torch.tensor(1.0)
        else:
            mean, std = members.mean(), members.std()
        adv[rows] = (members - mean) / (std + eps) if std_normalise else members - mean
    return adv[:, None] * mask


def _outcome(x: AdvantageInputs, per_response: torch.Tensor, rewards: torch.Tensor) -> dict[str, torch.Tensor]:
    """One advantage per response broadcast to its tokens; the returns are the advantages (no critic)."""
    adv = per_response[:, None] * x.mask
    return {"adv": adv, "returns": adv, "rewards": rewards}


def gae_estimator(x: AdvantageInputs) -> dict[str, torch.Tensor]:
    """PPO's advantages: per-token rewards (score on the last token, minus the KL penalty when one is
    set), GAE over the critic's values, advantages whitened over the batch; the returns are the critic's
    targets."""
    if x.values is None:
        raise ValueError("the gae advantage estimator needs critic values")
    rewards = step_rewards(x)
    adv, returns = gae(rewards, x.values, x.mask, x.gamma, x.lam)
    return {"adv": masked_whiten(adv, x.mask), "returns": returns, "rewards": rewards}


def grpo_estimator(x: AdvantageInputs) -> dict[str, torch.Tensor]:
    """GRPO's advantages: each response's summed token rewards (its score, minus the KL penalty when one
    is in the reward, as verl sums ``token_level_rewards``) normalised within its uid group. The returns are
    the advantages themselves, as verl's ``compute_grpo_outcome_advantage`` returns them (no critic)."""
    rewards = step_rewards(x)
    adv = grpo_advantages(rewards.sum(-1), x.groups, x.mask, x.norm_adv_by_std)
    return {"adv": adv, "returns": adv, "rewards": rewards}


def grpo_vectorized_estimator(x: AdvantageInputs) -> dict[str, torch.Tensor]:
    """GRPO's advantages with every group's statistics gathered at once (sums and sums of squares per
    uid): (s − μ_g) / (σ_g + 1e-6). As verl's ``grpo_vectorized`` (``verl.utils.group_mean_std``) the
    group's unbiased variance is floored at 1e-6 before the square root, so it equals ``grpo`` wherever a
    group's variance exceeds 1e-6 and both give 0 to a group of equal scores; a group of one has mean 0 and
    std 1."""
    rewards = step_rewards(x)
    s = rewards.sum(-1).float()
    _, inv, count = torch.unique(x.groups, return_inverse=True, return_counts=True)
    count = count.float()
    total = torch.zeros_like(count).index_add_(0, inv, s)
    squares = torch.zeros_like(count).index_add_(0, inv, s * s)
    mean = total / count
    std = ((squares - total * total / count) / (count - 1).clamp(min=1)).clamp(min=GROUP_EPS).sqrt()
    alone = count <= 1
    mean, std = mean.masked_fill(alone, 0.0), std.masked_fill(alone, 1.0)
    centred = s - mean[inv]
    return _outcome(x, centred / (std[inv] + GROUP_EPS) if x.norm_adv_by_std else centred, rewards)


def rloo_estimator(x: AdvantageInputs) -> dict[str, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740, eq. 7; Kool et al. 2019): each of a prompt's k
    responses is baselined by the mean score of the other k − 1, s_i − (Σ_j s_j − s_i)/(k − 1)
    = k/(k − 1)·(s_i − mean). A group of one has no other response: its score is left as it is (verl's
    ``rloo``; ``rloo_vectorized`` gives it 0)."""
    rewards = step_rewards(x)
    s = rewards.sum(-1).float()
    adv = s.clone()
    for rows in group_rows(x.groups):
        k = len(rows)
        if k > 1:
            adv[rows] = (s[rows] - s[rows].mean()) * (k / (k - 1))
    return _outcome(x, adv, rewards)


def rloo_vectorized_estimator(x: AdvantageInputs) -> dict[str, torch.Tensor]:
    """RLOO's leave-one-out baseline (Ahmadian et al. 2024, arXiv:2402.14740) from per-group counts and
    sums at once: (k·s_i − Σ_j s_j)/(k − 1). As verl's ``rloo_vectorized``, a group of one gets 0 (verl's
    plain ``rloo`` keeps its score); otherwise equal to ``rloo``."""
    rewards = step_rewards(x)
    s = rewards.sum(-1).float()
    _, inv, count = torch.unique(x.groups, return_inverse=True, return_counts=True)
    k = count.float()[inv]
    total = s.new_zeros(len(count)).index_add_(0, inv, s)[inv]
    adv = (k * s - total) / (k - 1).clamp(min=1) * (k > 1)
    return _outcome(x, adv, rewards)


def reinforce_plus_plus_estimator(x: AdvantageInputs) -> dict[str, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262, §3): the discounted return from each token,
    G_t = Σ_{l ≥ t} γ^{l−t} r_l (the KL penalty is in the token rewards), whitened over every response
    token of the batch (global advantage normalisation). The returns are the unwhitened G_t."""
    rewards = step_rewards(x)
    mask = x.mask.to(rewards.dtype)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + x.gamma * running
        returns[:, t] = running
        running = running * mask[:, t]  # nothing flows back from past the response's end
    return {"adv": masked_whiten(returns, mask), "returns": returns, "rewards": rewards}


def _group_mean(s: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Each response's group mean score [B]; 0 for a group of one (verl's convention)."""
    mean = torch.zeros_like(s)
    for rows in group_rows(groups):
        if len(rows) > 1:
            mean[rows] = s[rows].mean()
    return mean


def reinforce_plus_plus_baseline_estimator(x: AdvantageInputs) -> dict[str, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262, §3.2): each response's score minus its prompt
    group's mean (a group of one keeps its score), broadcast to its tokens and then whitened over every
    response token of the batch (global normalisation)."""
    rewards = step_rewards(x)
    s = rewards.sum(-1).float()
    centred = (s - _group_mean(s, x.groups))[:, None] * x.mask
    adv = masked_whiten(centred, x.mask)
    return {"adv": adv, "returns": adv, "rewards": rewards}


def remax_estimator(x: AdvantageInputs) -> dict[str, torch.Tensor]:
    """ReMax (Li et al. 2023, arXiv:2310.10505, Algorithm 1): REINFORCE whose baseline is the reward of
    the greedy response to the same prompt, A_t = G_t − r(x, ŷ_greedy), with G_t the reward-to-go of the
    sampled response. ``baseline_scores`` holds r(x, ŷ_greedy) per row; the returns are G_t."""
    if x.baseline_scores is None:
        raise ValueError("the remax advantage estimator needs baseline_scores (the greedy response's score)")
    rewards = step_rewards(x)
    returns = reward_to_go(rewards, x.mask)
    adv = returns - x.baseline_scores.float()[:, None] * x.mask
    return {"adv": adv, "returns": returns, "rewards": rewards}


def opo_estimator(x: AdvantageInputs) -> dict[str, torch.Tensor]:
    """OPO (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline", arXiv:2505.23585, eq. 6): the
    variance-minimising baseline of a sequence-level reward, the group's scores weighted by response
    length, b = Σ_i |y_i|·s_i / Σ_i |y_i|; A_i = s_i − b (0 baseline for a group of one, as verl)."""
    rewards = step_rewards(x)
    s = rewards.sum(-1).float()
    length = x.mask.sum(-1).float()
    baseline = torch.zeros_like(s)
    for rows in group_rows(x.groups):
        if len(rows) > 1:
            baseline[rows] = (length[rows] * s[rows]).sum() / length[rows].sum()
    return _outcome(x, s - baseline, rewards)


def gpg_estimator(x: AdvantageInputs) -> dict[str, torch.Tensor]:
    """GPG (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline", arXiv:2504.02546,
    eq. 9): the group-mean-centred score without the std division, scaled by α = B / M, where M counts the
    responses with a non-zero score (verl's reading of the paper's valid samples; at least 1), and divided
    by F_norm = 1: A_i = α·(s_i − mean_g). A group of one has mean 0."""
    rewards = step_rewards(x)
    s = rewards.sum(-1).float()
    alpha = len(s) / max(int(torch.count_nonzero(s)), 1)
    return _outcome(x, alpha * (s - _group_mean(s, x.groups)), rewards)


def grpo_passk_estimator(x: AdvantageInputs) -> dict[str, torch.Tensor]:
    """Pass@k training (Chen et al. 2025, "Pass@k Training for Adaptively Balancing Exploration and
    Exploitation", arXiv:2503.19595 as verl cites it): only the best response of each group is credited,
    with its margin over the runner-up, A = (r_max − r_2nd) / (σ_g + 1e-6) (σ_g the group's unbiased std;
    no division when ``norm_adv_by_std`` is off); every other response gets 0. Needs 2 responses per group."""
    rewards = step_rewards(x)
    s = rewards.sum(-1).float()
    adv = torch.zeros_like(s)
    for rows in group_rows(x.groups):
        if len(rows) < 2:
            raise ValueError(f"grpo_passk needs at least 2 responses per group; a group has {len(rows)}")
        top, where = torch.topk(s[rows], 2)
        margin = top[0] - top[1]
        adv[rows[where[0]]] = margin / (s[rows].std() + GROUP_EPS) if x.norm_adv_by_std else margin
    return _outcome(x, adv, rewards)


def gdpo_estimator(x: AdvantageInputs) -> dict[str, torch.Tensor]:
    """GDPO (group reward-decoupled normalisation, arXiv:2601.05242 as verl cites it): each reward
    component is group-normalised on its own, A_k = GRPO(r_k), the components are summed with their
    weights, Σ_k w_k·A_k, and the sum is whitened over every response token of the batch, so one large
    component cannot drown the others. Without ``score_components`` the one component is the summed token
    rewards (what verl's trainer passes when no ``gdpo_reward_keys`` are given)."""
    rewards = step_rewards(x)
    parts = dict(x.score_components) if x.score_components else {"score": rewards.sum(-1)}
    weights = x.score_weights or {}
    total = torch.zeros_like(rewards)
    for name, component in parts.items():
        total = total + float(weights.get(name, 1.0)) * grpo_advantages(component, x.groups, x.mask,
                                                                        x.norm_adv_by_std)
    adv = masked_whiten(total, x.mask)
    return {"adv": adv, "returns": adv, "rewards": rewards}
