"""The PPO/GRPO losses, run on the workers inside ``Runtime.train_step`` on a micro-batch's ``TrainBatch``:
each returns its scalar with a record of the micro-batch's statistics (a ``sharded.Loss`` holding an
``ActorLossStats`` or ``CriticLossStats``), which come back in the step's ``TrainStats``. Checkpoints
read and write shards and Adam state through ``Runtime.read_weights`` / ``read_optimizer`` /
``write_optimizer``; weights move between layouts through the live transition executor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from functools import partial

import torch

from nereus.rl.core import clipped_value_loss, kl_estimate, masked_mean
from nereus.rl.policy_loss_types import CLIPFRAC, CLIPFRAC_LOWER, PPO_KL, LossMatrix, PolicyLossOptions
from nereus.rl.policy_losses import POLICY_LOSS_FNS, policy_loss_fn, token_metrics
from nereus.rl.user_registry import USER_POLICY_LOSSES
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
    # the policy loss's other metrics under verl's names (rl.policy_losses: e.g. bypass_mode's rollout_corr/*),
    # token means over the micro-batch like the clip fractions
    metrics: dict[str, float] = field(default_factory=dict)


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


def _aggregate(x: torch.Tensor, mb: TrainBatch, weight: torch.Tensor | None = None) -> torch.Tensor:
    """This micro-batch's share of the mini-batch aggregate of ``x``: ``mb.weight`` (or ``weight``) holds the
    ``loss_agg_mode`` weights of the whole mini-batch (``rl.core.agg_weights``), so Σ weight·x / rows,
    after the engine's mean over equal micro-batches and replicas, is verl's ``agg_loss`` over the
    mini-batch under any layout."""
    return (x * (mb.weight if weight is None else weight)).sum() / len(x)


def actor_loss(out: torch.Tensor, mb: TrainBatch, clip_low: float, clip_high: float | None,
               kl_loss_coef: float, kl_loss_type: str, clip_ratio_c: float | None = 3.0,
               entropy_coeff: float = 0.0, loss_mode: str = "vanilla",
               loss_options: Mapping[str, object] | None = None, user_loss: Callable | None = None,
               loss_agg_mode: str = "token-mean") -> Loss:
    """The policy loss registered as ``loss_mode`` (``rl.policy_losses``; PPO's clipped surrogate with
    dual-clip by default, Schulman et al. 2017, Ye et al. 2020) with verl's options ``loss_options`` and
    the clip bounds, minus ``entropy_coeff`` × the full-vocabulary entropy (``mb.entropy``, present when
    the loss is built by ``policy_loss`` with a non-zero coefficient), plus, with a KL loss,
    β·KL(π‖π_ref) (Shao et al. 2024, eq. 3); every term aggregated by the job's ``loss_agg_mode`` as
    verl's ``update_policy`` does (pg_loss − entropy_coeff · entropy + kl_loss_coef · kl_loss), the policy
    term by its own where the loss fixes one (``mb.pg_weight``). With ``run.async`` each token's policy
    loss is weighted by π_old/π_rollout (``mb.is_weight``: verl's ``rollout_is_weights``; decoupled PPO,
    ``rl.offpolicy``)."""
    logp, mask = _response(out, mb), mb.mask
    options = PolicyLossOptions.of({**(loss_options or {}), "clip_ratio_low": clip_low,
                                    "clip_ratio_high": clip_low if clip_high is None else clip_high,
                                    "clip_ratio_c": clip_ratio_c})
    if user_loss is not None:  # a job's own loss (run.algorithm_modules): it aggregates its micro-batch itself
        pg, user_metrics = user_loss(logp, mb.old_logp, mb.advantages, mask, loss_agg_mode=loss_agg_mode,
                                     rollout_is_weights=mb.is_weight, **asdict(options))
        matrix = LossMatrix(torch.zeros_like(mask), {}, extra={})
    else:
        matrix = policy_loss_fn(loss_mode).matrix(logp, mb.old_logp, mb.advantages, mask, mb.is_weight, options)
        pg, user_metrics = _aggregate(matrix.loss, mb, mb.pg_weight), None
    loss = pg
    kl = torch.zeros_like(matrix.loss)
    if kl_loss_coef and mb.ref_logp is not None:
        kl = kl_estimate(logp, mb.ref_logp, kl_loss_type)
        loss = loss + kl_loss_coef * _aggregate(kl, mb)
    entropy_stat = None
    if entropy_coeff:
        entropy = _aggregate(_response(mb.entropy, mb), mb)
        loss = loss - entropy_coeff * entropy
        entropy_stat = float(entropy.detach())
    stats = _actor_stats(logp, mb, matrix, pg, kl, entropy_stat)
    if user_metrics is not None:
        stats = _with_user_metrics(stats, user_metrics)
    return Loss(loss, stats)


def _with_user_metrics(stats: ActorLossStats, metrics: Mapping[str, object]) -> ActorLossStats:
    """``stats`` with a user loss's metrics: verl's clip fractions and ``ppo_kl`` where it reports them
    (under verl's names), the rest as its own figures."""
    values = {str(k): float(v) for k, v in metrics.items()}  # tensors and numbers alike
    return replace(stats, pg_clipfrac=values.pop(CLIPFRAC, 0.0), pg_clipfrac_lower=values.pop(CLIPFRAC_LOWER, 0.0),
                   ppo_kl=values.pop(PPO_KL, stats.ppo_kl), metrics=values)


def _actor_stats(logp: torch.Tensor, mb: TrainBatch, matrix: LossMatrix, pg: torch.Tensor, kl: torch.Tensor,
                 entropy: float | None) -> ActorLossStats:
    """The micro-batch's record: verl's clip fractions and ``ppo_kl`` where the loss reports them (0, resp.
    the mean old − new log-prob, where it does not: GPG), its other metrics, and the largest |r − 1|."""
    mask = mb.mask
    with torch.no_grad():
        metrics = token_metrics(matrix, mask)
        ratio = torch.exp((logp - mb.old_logp).clamp(-20, 20))  # a collapse shows here first
        ratio_max_dev = float(((ratio - 1).abs() * mask).max()) if mask.numel() else 0.0
        ppo_kl = metrics.pop(PPO_KL, None)
        return ActorLossStats(tokens=float(mask.sum()), pg_loss=float(pg), pg_clipfrac=metrics.pop(CLIPFRAC, 0.0),
                              pg_clipfrac_lower=metrics.pop(CLIPFRAC_LOWER, 0.0),
                              ppo_kl=float(masked_mean(mb.old_logp - logp, mask)) if ppo_kl is None else ppo_kl,
                              kl_loss=float(_aggregate(kl, mb)), ratio_max_dev=ratio_max_dev, entropy=entropy,
                              metrics=metrics)


def policy_loss(**options: object) -> partial:
    """``actor_loss`` with the job's options, marked ``needs_entropy`` when it trains on the entropy, so
    the engine hands it each token's full-vocabulary entropy (``ShardedModel.backward``), and with
    ``pg_agg_mode``, the aggregation its policy loss fixes (None: the job's), for ``run.rollout.mini_batches``."""
    mode = str(options.get("loss_mode", "vanilla"))
    user = USER_POLICY_LOSSES.get(mode) if mode not in POLICY_LOSS_FNS else None
    fn = partial(actor_loss, **options, **({"user_loss": user} if user is not None else {}))
    fn.needs_entropy = bool(options.get("entropy_coeff"))
    fn.pg_agg_mode = None if user is not None else policy_loss_fn(mode).agg_mode
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
