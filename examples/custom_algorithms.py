"""Your own advantage estimator and policy loss, registered as verl users do (docs/rl.md, "Your own
algorithm"). A job names this file under run.algorithm_modules and then selects the names:

    nereus run examples/grpo_tiny.yaml run.algorithm_modules=[custom_algorithms.py] \
        algorithm.adv_estimator=leave_one_out_mean run.policy_loss.loss_mode=clipped_no_dual

(a relative path starts at the job file's folder). Validating the job reads the names from the decorators
without running this file; the run imports it once the job is accepted.
"""

import torch

from nereus.rl.core import agg_loss, register_adv_est, register_policy_loss


@register_adv_est("leave_one_out_mean")
def leave_one_out_mean(x):
    """Each response's score minus the mean of the other responses to its prompt (RLOO's baseline,
    Ahmadian et al. 2024, arXiv:2402.14740), written plainly, one group at a time."""
    adv = torch.zeros_like(x.scores, dtype=torch.float32)
    for g in torch.unique(x.groups):
        members = x.groups == g
        n = int(members.sum())
        s = x.scores[members].float()
        adv[members] = s - (s.sum() - s) / max(n - 1, 1) if n > 1 else s
    adv = adv[:, None] * x.mask
    return {"adv": adv, "returns": adv}


@register_policy_loss("clipped_no_dual")
def clipped_no_dual(logp, old_logp, adv, mask, *, loss_agg_mode, rollout_is_weights=None, clip_ratio_low=0.2,
                    clip_ratio_high=0.2, **options):
    """PPO's clipped surrogate (Schulman et al. 2017, eq. 7) without the dual clip."""
    ratio = torch.exp((logp - old_logp).clamp(-20, 20))
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    if rollout_is_weights is not None:
        loss = loss * rollout_is_weights
    frac = ((clipped > unclipped).float() * mask).sum() / mask.sum().clamp(min=1)
    return agg_loss(loss, mask, loss_agg_mode), {"actor/pg_clipfrac": float(frac)}
