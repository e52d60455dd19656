"""The PPO/GRPO losses, run on the workers inside ``Runtime.train_step``: each returns its scalar with the
micro-batch's statistics (``engine.Loss``), which come back in the step's ``TrainStats``. Checkpoints
read and write shards and Adam state through ``Runtime.read_weights`` / ``read_optimizer`` /
``write_optimizer``; weights move between layouts through the live transition executor.
"""

from __future__ import annotations

import torch

from nereus.rl.core import clipped_policy_loss, clipped_value_loss, kl_estimate, masked_mean
from nereus.runtime.engine import Loss


def _response(out: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per response token [b, R] from the model's per-position output (log-probs [b, T−1] or values
    [b, T]) at the batch's ``index`` positions."""
    return out.gather(1, mb["index"])


def actor_loss(out: torch.Tensor, mb: dict[str, torch.Tensor], clip_low: float, clip_high: float | None,
               kl_loss_coef: float, kl_loss_type: str) -> Loss:
    """PPO clipped surrogate (Schulman et al. 2017) plus, for GRPO, β·KL(π‖π_ref) as a loss (Shao et al.
    2024, eq. 3). ``mb["weight"]`` is mask · (mini-batch rows / mini-batch response tokens), so summing
    weight·loss over rows and dividing by the micro-batch's rows gives, after the engine's mean over
    micro-batches and replicas, the token mean over the whole mini-batch under any layout."""
    logp, mask, weight = _response(out, mb), mb["mask"], mb["weight"]
    pg, clipped = clipped_policy_loss(logp, mb["old_logp"], mb["adv"], clip_low, clip_high)
    loss = pg
    kl = torch.zeros_like(pg)
    if kl_loss_coef and "ref_logp" in mb:
        kl = kl_estimate(logp, mb["ref_logp"], kl_loss_type)
        loss = pg + kl_loss_coef * kl
    with torch.no_grad():
        stats = {"tokens": float(mask.sum()), "pg_loss": float(masked_mean(pg, mask)),
                 "pg_clipfrac": float(masked_mean(clipped, mask)),
                 "ppo_kl": float(masked_mean(mb["old_logp"] - logp, mask)),
                 "kl_loss": float(masked_mean(kl, mask))}
    return Loss((loss * weight).sum() / len(logp), stats)


def critic_loss(out: torch.Tensor, mb: dict[str, torch.Tensor], clip: float) -> Loss:
    """Clipped value loss towards the GAE returns, token mean over the mini-batch (as ``actor_loss``)."""
    values, mask = _response(out, mb), mb["mask"]
    loss, clipped = clipped_value_loss(values, mb["old_values"], mb["returns"], clip)
    with torch.no_grad():
        stats = {"tokens": float(mask.sum()), "vf_loss": float(masked_mean(loss, mask)),
                 "vf_clipfrac": float(masked_mean(clipped, mask))}
    return Loss((loss * mb["weight"]).sum() / len(values), stats)
