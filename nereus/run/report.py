"""A step's metrics under verl's names (verl/trainer/ppo/metric_utils.py and ray_trainer.py; the table
side by side is in docs/rl.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nereus.cost.tail.lengths import sibling_correlation
from nereus.rl.core import agg_loss, masked_mean
from nereus.run.rollout import Rollout
from nereus.spec.job import JobSpec

if TYPE_CHECKING:
    from nereus.rl.losses import ActorLossStats, CriticLossStats
    from nereus.run.inference import Inferred
    from nereus.run.training import ModelUpdate


def step_metrics(job: JobSpec, step: int, roll: Rollout, inf: Inferred, adv: dict[str, torch.Tensor],
                 trained: dict[str, ModelUpdate], timing: dict[str, float]) -> dict[str, float]:
    """Step ``step``'s metric line: its rollout ``roll``, inference ``inf``, advantages ``adv`` (the
    estimator's), each trained model's update and the step's ``timing_s/*``."""
    r, n = job.run, job.algorithm.samples_per_prompt
    limit = r.max_response_length(step, job.workload.response.max)
    rlen = roll.response_len.float()
    m: dict[str, float] = {
        "training/global_step": float(step + 1),
        "curriculum/max_response_length": float(limit),
        "response_length/mean": float(rlen.mean()), "response_length/max": float(rlen.max()),
        "response_length/min": float(rlen.min()),
        "response_length/clip_ratio": float(((roll.response_len >= limit) & ~roll.finished).float().mean()),
        # the correlation of sibling responses' log lengths (ICC(1) over the step's groups; 0 when undefined)
        "response_length/sibling_correlation": sibling_correlation(rlen.tolist(), n) or 0.0,
        # the spread of log lengths (a log-normal's sigma: the length model the cost model prices)
        "response_length/log_std": float(rlen.clamp(min=1).log().std(unbiased=False)),
        "prompt_length/mean": float(roll.prompt_len.float().mean()),
        "prompt_length/max": float(roll.prompt_len.max()), "prompt_length/min": float(roll.prompt_len.min()),
        "critic/score/mean": float(inf.score.mean()), "critic/score/max": float(inf.score.max()),
        "critic/score/min": float(inf.score.min()),
    }
    if inf.rule is not None:
        m["reward/rule/mean"] = float(inf.rule.mean())
    if n > 1:  # GRPO's groups: how many carry a learning signal
        m.update(solve_shares(inf.score, n))
    if inf.rm is not None:
        m["reward_model/score/mean"] = float(inf.rm.mean())
    m.update(critic_metrics(job, step, roll.mask, inf, adv, trained.get("critic")))
    m.update(actor_metrics(job, step, roll, inf, trained.get("actor"), limit))
    m.update({f"{model}/grad_norm": u.grad_norm for model, u in trained.items() if u.grad_norm is not None})
    m.update(timing)
    tokens = int(roll.prompt_len.sum() + roll.response_len.sum())
    m["perf/total_num_tokens"] = float(tokens)
    # verl reports tokens per second per device; the workers are the devices here
    m["perf/throughput"] = tokens / max(timing["timing_s/step"], 1e-9) / max(1, r.workers)
    m["perf/time_per_step"] = timing["timing_s/step"]
    return {k: float(v) for k, v in m.items() if not torch.is_tensor(v)}


def critic_metrics(job: JobSpec, step: int, mask: torch.Tensor, inf: Inferred, adv: dict[str, torch.Tensor],
                   critic: ModelUpdate | None) -> dict[str, float]:
    """verl's ``critic/*`` figures: advantages, rewards, returns (GRPO: the advantages, as verl's) and, with a
    critic, its values and update."""
    m = masked_stats("critic/advantages", adv["adv"], mask)
    if "rewards" in adv:
        seq = (adv["rewards"] * mask).sum(1)
        m.update({"critic/rewards/mean": float(seq.mean()), "critic/rewards/max": float(seq.max()),
                  "critic/rewards/min": float(seq.min())})
    m.update(masked_stats("critic/returns", adv["returns"], mask))
    if inf.values is not None:
        m.update(masked_stats("critic/values", inf.values, mask))
        m["critic/vf_explained_var"] = explained_variance(adv["returns"], inf.values, mask)
        c, r = [s.loss for s in critic.stats], job.run
        m.update({"critic/vf_loss": mean([s.vf_loss for s in c]),
                  "critic/vf_clipfrac": weighted(c, [s.vf_clipfrac for s in c]),
                  "critic/vpred_mean": weighted(c, [s.vpred_mean for s in c]), "critic/lr": r.lr_at(r.critic_lr, step)})
    return m


def actor_metrics(job: JobSpec, step: int, roll: Rollout, inf: Inferred, actor: ModelUpdate | None,
                  limit: int) -> dict[str, float]:
    """verl's ``actor/*`` figures of the update (none in a ``run.critic_warmup`` step, ``actor`` None), the
    rollout policy's entropy, and how far the engine's log-probs are from the trainer's (``limit``: the
    step's maximum response length). The KL penalty in the reward is the driver's (``run.step_knobs``)."""
    r, mask = job.run, roll.mask
    m = {} if actor is None else actor_update_metrics(job, step, actor)
    if inf.entropy is not None:  # verl: the rollout policy's full-vocabulary entropy, aggregated as the loss
        m["actor/entropy"] = float(agg_loss(inf.entropy, mask, r.loss_agg_mode, limit))
    if job.algorithm.recompute_old_log_prob:  # else the old log-probs are the engine's: nothing to compare
        diff = ((roll.gen_logp - inf.old_logp).abs() * mask)
        m["rollout/logprob_diff_max"] = float(diff.max())
        m.update(rollout_probs_diff(roll.gen_logp, inf.old_logp, mask))
    return m


def actor_update_metrics(job: JobSpec, step: int, actor: ModelUpdate) -> dict[str, float]:
    """verl's ``actor/*`` figures of the actor's optimizer steps in step ``step``."""
    r = job.run
    a = [s.loss for s in actor.stats]
    m = {"actor/pg_loss": mean([s.pg_loss for s in a]), "actor/pg_clipfrac": weighted(a, [s.pg_clipfrac for s in a]),
         "actor/pg_clipfrac_lower": weighted(a, [s.pg_clipfrac_lower for s in a]),
         "actor/ppo_kl": weighted(a, [s.ppo_kl for s in a]), "actor/kl_loss": mean([s.kl_loss for s in a]),
         "actor/lr": r.lr_at(r.actor_lr, step, "actor")}
    # what warns of a collapse: the first mini-batch of a step is on-policy (ratio 1, ppo_kl 0), so the mean
    # above halves the last update's drift; these show it undiluted
    last = max(s.update for s in actor.stats)
    final = [s.loss for s in actor.stats if s.update == last]
    m["actor/ppo_kl_last"] = weighted(final, [s.ppo_kl for s in final])
    m["actor/ppo_ratio_max_deviation"] = max(s.ratio_max_dev for s in a)
    for name in dict.fromkeys(k for s in a for k in s.metrics):  # the loss's own (rl.policy_losses), token-weighted
        has = [s for s in a if name in s.metrics]
        m[name] = weighted(has, [s.metrics[name] for s in has])
    return m


def rollout_probs_diff(rollout_logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """verl's on-policy check of the rollout engine: |p_rollout − p_actor| of each response token, the
    probabilities the engine recorded while sampling against the trainer's old log-probs of the same
    tokens (verl's ``calculate_debug_metrics``: ``training/rollout_probs_diff_*``, with the Pearson
    correlation of the two probabilities)."""
    keep = mask.bool()
    p_roll, p_actor = rollout_logp.exp()[keep].double(), old_logp.exp()[keep].double()
    if p_roll.numel() < 2:
        return {"training/rollout_probs_diff_valid": 0.0}
    diff = (p_roll - p_actor).abs()
    corr = torch.corrcoef(torch.stack([p_roll, p_actor]))[0, 1]
    return {"training/rollout_probs_diff_valid": 1.0, "training/rollout_probs_diff_max": float(diff.max()),
            "training/rollout_probs_diff_mean": float(diff.mean()),
            "training/rollout_probs_diff_std": float(diff.std()),
            "training/rollout_actor_probs_pearson_corr": float(corr) if torch.isfinite(corr) else 1.0}


def solve_shares(scores: torch.Tensor, group_size: int) -> dict[str, float]:
    """Shares of the step's prompt groups (``group_size`` consecutive rows) that no sibling solved (every
    score ≤ 0), that every sibling solved (every score ≥ 1) and the rest, under the names verl's PRIME
    and DAPO recipes log (``batch/solve_none``, ``batch/solve_all``, ``batch/solve_partial``; they log
    counts, these are shares so that rounds of different sizes compare). A group whose siblings score
    alike has zero group-relative advantage: with 0/1 rule rewards only ``solve_partial`` groups teach
    the policy anything (GRPO, Shao et al. 2024, arXiv 2402.03300, eq. 3)."""
    n = scores.numel() // group_size
    if n == 0:
        return {}
    groups = scores[: n * group_size].reshape(n, group_size).double()
    none = float((groups <= 0).all(dim=1).sum()) / n
    every = float((groups >= 1).all(dim=1).sum()) / n
    return {"batch/solve_none": none, "batch/solve_all": every, "batch/solve_partial": 1.0 - none - every}


def mean(values: list[float]) -> float:
    """Mean of one statistic over micro-batches: for a loss, each micro-batch's share of its mini-batch's
    aggregate (``rl.losses._aggregate``), so this is the mean aggregate over the step's mini-batches."""
    return sum(values) / max(len(values), 1)


def weighted(stats: list[ActorLossStats] | list[CriticLossStats], values: list[float]) -> float:
    """Token-weighted mean over micro-batches of one statistic, ``values``, of the records ``stats``."""
    tokens = sum(s.tokens for s in stats)
    return sum(v * s.tokens for v, s in zip(values, stats, strict=True)) / max(tokens, 1.0)


def explained_variance(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> float:
    """1 − Var(R − V) / Var(R) over the response tokens (verl's critic/vf_explained_var, with its 1e-5
    in the denominator): 1 when the critic predicts the returns exactly, ≤ 0 when it explains nothing."""
    sel = mask.bool()
    r, v = returns[sel], values[sel]
    if r.numel() < 2:
        return 0.0
    return float(1.0 - torch.var(r - v) / (torch.var(r) + 1e-5))


def masked_stats(prefix: str, x: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    sel = x[mask.bool()]
    if sel.numel() == 0:
        return {f"{prefix}/mean": 0.0}
    return {f"{prefix}/mean": float(masked_mean(x, mask)), f"{prefix}/max": float(sel.max()),
            f"{prefix}/min": float(sel.min())}
