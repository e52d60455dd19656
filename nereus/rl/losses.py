"""The PPO/GRPO losses, run on the workers inside ``Runtime.train_step`` on a micro-batch's ``TrainBatch``:
each returns its scalar with a record of the micro-batch's statistics (a ``sharded.Loss`` holding an
``ActorLossStats`` or ``CriticLossStats``), which come back in the step's ``TrainStats``. Checkpoints
read and write shards and Adam state through ``Runtime.read_weights`` / ``read_optimizer`` /
``write_optimizer``; weights move between layouts through the live transition executor.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from nereus.rl.core import clipped_policy_loss, clipped_value_loss, kl_estimate, masked_mean
from nereus.rl.offpolicy import decoupled_policy_loss
from nereus.runtime.parallel.batch import TrainBatch
from nereus.runtime.parallel.sharded import Loss


@dataclass(frozen=True)
class ActorLossStats:
    """One micro-batch's actor statistics (``actor_loss``); ``run.report`` averages them over the step
    into verl's ``actor/*`` figures. Losses are the micro-batch's share of its mini-batch's aggregate."""

    tokens: float  # response tokens in the micro-batch (the weight of the token-weighted means)
    pg_loss: float
    pg_clipfrac: float
    pg_clipfrac_lower: float  # where the dual clip bites
    ppo_kl: float  # masked mean of old − new log-probs
    kl_loss: float
    ratio_max_dev: float  # the largest |π/π_old − 1| over the micro-batch's tokens
    entropy: float | None = None  # the aggregated entropy, with an entropy bonus


@dataclass(frozen=True)
class CriticLossStats:
    """One micro-batch's critic statistics (``critic_loss``), verl's ``critic/*`` figures per micro-batch."""

    tokens: float
    vf_loss: float
    vf_clipfrac: float
    vpred_mean: float


def _response(out: torch.Tensor, mb: TrainBatch) -> torch.Tensor:
    """Per response token [b, R] from the model's per-position output (log-probs [b, T−1] or values
    [b, T]) at the batch's ``index`` positions."""
    return out.gather(1, mb.index)


def _aggregate(x: torch.Tensor, mb: TrainBatch) -> torch.Tensor:
    """This micro-batch's share of the mini-batch aggregate of ``x``: ``mb.weight`` holds the
    ``loss_agg_mode`` weights of the whole mini-batch (``rl.core.agg_weights``), so Σ weight·x / rows,
    after the engine's mean over equal micro-batches and replicas, is verl's ``agg_loss`` over the
    mini-batch under any layout."""
    return (x * mb.weight).sum() / len(x)


def actor_loss(out: torch.Tensor, mb: TrainBatch, clip_low: float, clip_high: float | None,
               kl_loss_coef: float, kl_loss_type: str, clip_ratio_c: float | None = 3.0,
               entropy_coeff: float = 0.0) -> Loss:
    """PPO clipped surrogate with dual-clip (Schulman et al. 2017; Ye et al. 2020), minus
    ``entropy_coeff`` × the full-vocabulary entropy (``mb.entropy``, present when the loss is built by
    ``policy_loss`` with a non-zero coefficient), plus, with a KL loss, β·KL(π‖π_ref) (Shao et al. 2024,
    eq. 3); every term aggregated by the job's ``loss_agg_mode`` as verl's ``update_policy`` does
    (pg_loss − entropy_coeff · entropy + kl_loss_coef · kl_loss)."""
    logp, mask = _response(out, mb), mb.mask
    if mb.is_weight is not None:  # run.async: each token weighted by pi_old / pi_rollout (decoupled PPO, rl.offpolicy)
        pg, clipped, lower = decoupled_policy_loss(logp, mb.old_logp, mb.advantages, mb.is_weight, clip_low,
                                                   clip_high, clip_ratio_c)
    else:
        pg, clipped, lower = clipped_policy_loss(logp, mb.old_logp, mb.advantages, clip_low, clip_high, clip_ratio_c)
    loss = pg
    kl = torch.zeros_like(pg)
    if kl_loss_coef and mb.ref_logp is not None:
        kl = kl_estimate(logp, mb.ref_logp, kl_loss_type)
        loss = loss + kl_loss_coef * kl
    with torch.no_grad():  # the largest |r - 1| over the micro-batch's tokens: a collapse shows here first
        ratio = torch.exp((logp - mb.old_logp).clamp(-20, 20))
        ratio_max_dev = float(((ratio - 1).abs() * mask).max()) if mask.numel() else 0.0
    entropy_stat = None
    if entropy_coeff:
        entropy = _response(mb.entropy, mb)
        loss = loss - entropy_coeff * entropy
        entropy_stat = float(_aggregate(entropy.detach(), mb))
    with torch.no_grad():
        stats = ActorLossStats(tokens=float(mask.sum()), pg_loss=float(_aggregate(pg, mb)),
                               pg_clipfrac=float(masked_mean(clipped, mask)),
                               pg_clipfrac_lower=float(masked_mean(lower, mask)),
                               ppo_kl=float(masked_mean(mb.old_logp - logp, mask)),
                               kl_loss=float(_aggregate(kl, mb)), ratio_max_dev=ratio_max_dev, entropy=entropy_stat)
    return Loss(_aggregate(loss, mb), stats)


def policy_loss(**options: object) -> partial:
    """``actor_loss`` with the job's options, marked ``needs_entropy`` when it trains on the entropy, so
    the engine hands it each token's full-vocabulary entropy (``ShardedModel.backward``)."""
    fn = partial(actor_loss, **options)
    fn.needs_entropy = bool(options.get("entropy_coeff"))
    return fn


def critic_loss(out: torch.Tensor, mb: TrainBatch, clip: float) -> Loss:
    """Clipped value loss towards the GAE returns, aggregated as ``actor_loss`` (verl's critic uses the
    actor's ``loss_agg_mode`` by default)."""
    values, mask = _response(out, mb), mb.mask
    loss, clipped = clipped_value_loss(values, mb.old_values, mb.returns, clip)
    with torch.no_grad():
        stats = CriticLossStats(tokens=float(mask.sum()), vf_loss=float(_aggregate(loss, mb)),
                                vf_clipfrac=float(masked_mean(clipped, mask)),
                                vpred_mean=float(masked_mean(values, mask)))
    return Loss(_aggregate(loss, mb), stats)
