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
from nereus.rl.objectives import agg_loss, agg_weights, clipped_policy_loss, clipped_value_loss, entropy_from_logits  # noqa: F401
from nereus.rl.policy_loss_types import LossMatrix, PolicyLossOptions  # noqa: F401
from nereus.rl.policy_losses import POLICY_LOSS_FNS, PolicyLoss
from nereus.rl.policy_losses import policy_loss_fn as builtin_policy_loss
from nereus.rl.registry import name_table
from nereus.rl.token_baseline import optimal_token_baseline_estimator, tir_optimal_token_baseline_estimator
from nereus.rl.user_registry import (  # noqa: F401 - verl's decorators, re-exported for user modules
    USER_ADVANTAGE_ESTIMATORS,
    USER_POLICY_LOSSES,
    register_adv_est,
    register_policy_loss,
)
from nereus.spec.algorithms import ADVANTAGE_ESTIMATORS

ADVANTAGE_ESTIMATOR_FNS = name_table(ADVANTAGE_ESTIMATORS, {
    "gae": gae_estimator, "grpo": grpo_estimator, "reinforce_plus_plus": reinforce_plus_plus_estimator,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline_estimator, "remax": remax_estimator,
    "rloo": rloo_estimator, "opo": opo_estimator, "grpo_passk": grpo_passk_estimator, "gpg": gpg_estimator,
    "rloo_vectorized": rloo_vectorized_estimator, "grpo_vectorized": grpo_vectorized_estimator,
    "optimal_token_baseline": optimal_token_baseline_estimator,
    "tir_optimal_token_baseline": tir_optimal_token_baseline_estimator, "gdpo": gdpo_estimator})


def advantage_estimator(name: str) -> Callable[[AdvantageInputs], dict[str, torch.Tensor]]:
    """The estimator registered as ``name`` (a spec's ``algorithm.adv_estimator``)."""
    if name in ADVANTAGE_ESTIMATOR_FNS:
        return ADVANTAGE_ESTIMATOR_FNS[name]
    if name in USER_ADVANTAGE_ESTIMATORS:  # registered by a job's run.algorithm_modules (rl.user_registry)
        return USER_ADVANTAGE_ESTIMATORS[name]
    known = list(ADVANTAGE_ESTIMATOR_FNS) + list(USER_ADVANTAGE_ESTIMATORS)
    raise ValueError(f"unknown advantage estimator {name!r}; choose one of {known}")


def policy_loss_fn(name: str) -> PolicyLoss | Callable:
    """The policy loss registered as ``name`` (verl's ``get_policy_loss_fn``; ``run.policy_loss.loss_mode``):
    ``fn(logp, old_logp, adv, mask, *, loss_agg_mode, rollout_is_weights=None, **options) -> (loss, metrics)``
    with verl's actor options and metric names; a built-in (``rl.policy_losses``) or one a job's
    ``run.algorithm_modules`` registered."""
    if name not in POLICY_LOSS_FNS and name in USER_POLICY_LOSSES:
        return USER_POLICY_LOSSES[name]
    return builtin_policy_loss(name)
