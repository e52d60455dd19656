"""A step's metrics under verl's names."""

from __future__ import annotations

import torch

from nereus.rl.core import kl_estimate, masked_mean
from nereus.run.rollout import Rollout


def step_metrics(st: object, step: int, roll: Rollout, inf: dict, adv: dict, stats: dict) -> dict[str, float]:
    mask, r = roll.mask, st.run
    limit = r.max_response_length(step, st.job.workload.response.max)
    rlen = roll.response_len.float()
    m: dict[str, float] = {
        "training/global_step": float(step + 1),
        "curriculum/max_response_length": float(limit),
        "response_length/mean": float(rlen.mean()), "response_length/max": float(rlen.max()),
        "response_length/min": float(rlen.min()),
        "response_length/clip_ratio": float(((roll.response_len >= limit) & ~roll.finished).float().mean()),
        "prompt_length/mean": float(roll.prompt_len.float().mean()),
        "critic/score/mean": float(inf["score"].mean()), "critic/score/max": float(inf["score"].max()),
        "critic/score/min": float(inf["score"].min()),
    }
    if "rule" in inf:
        m["reward/rule/mean"] = float(inf["rule"].mean())
    if "rm" in inf:
        m["reward_model/score/mean"] = float(inf["rm"].mean())
    m.update(masked_stats("critic/advantages", adv["adv"], mask))
    if "returns" in adv:
        m.update(masked_stats("critic/returns", adv["returns"], mask))
        m.update(masked_stats("critic/values", inf["values"], mask))
        m["critic/rewards/mean"] = float((adv["rewards"] * mask).sum(1).mean())
        m["critic/vf_loss"] = weighted(stats["critic"], "vf_loss")
        m["critic/vf_clipfrac"] = weighted(stats["critic"], "vf_clipfrac")
        m["critic/lr"] = r.critic_lr
    a = stats["actor"]
    m.update({"actor/pg_loss": weighted(a, "pg_loss"), "actor/pg_clipfrac": weighted(a, "pg_clipfrac"),
              "actor/ppo_kl": weighted(a, "ppo_kl"), "actor/kl_loss": weighted(a, "kl_loss"),
              "actor/lr": r.actor_lr,
              # −E[log π(a)] over sampled tokens: an unbiased estimate of the policy's entropy
              "actor/entropy": float(-masked_mean(inf["old_logp"], mask))})
    if "ref_logp" in inf:
        m["actor/kl"] = float(masked_mean(kl_estimate(inf["old_logp"], inf["ref_logp"], r.kl_loss_type), mask))
    diff = ((roll.gen_logp - inf["old_logp"]).abs() * mask)
    m["rollout/logprob_diff_max"] = float(diff.max())
    m.update({f"{model}/grad_norm": norm for model, norm in st.grad_norms.items()})
    m.update(st.timing)
    tokens = int(roll.prompt_len.sum() + roll.response_len.sum())
    m["perf/total_num_tokens"] = float(tokens)
    # verl reports tokens per second per device; the workers are the devices here
    m["perf/throughput"] = tokens / max(st.timing["timing_s/step"], 1e-9) / max(1, r.workers)
    return {k: float(v) for k, v in m.items() if not torch.is_tensor(v)}


def weighted(stats: list[dict[str, float]], name: str) -> float:
    """Token-weighted mean of one statistic over micro-batches."""
    tokens = sum(s["tokens"] for s in stats)
    return sum(s[name] * s["tokens"] for s in stats) / max(tokens, 1.0)


def masked_stats(prefix: str, x: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    sel = x[mask.bool()]
    if sel.numel() == 0:
        return {f"{prefix}/mean": 0.0}
    return {f"{prefix}/mean": float(masked_mean(x, mask)), f"{prefix}/max": float(sel.max()),
            f"{prefix}/min": float(sel.min())}
