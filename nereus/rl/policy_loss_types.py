"""The values the policy losses (``rl.policy_losses``) share: their options under verl's actor keys, the
per-token result of a loss, and verl's metric names."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields

import torch

# verl's metric names (verl/trainer/ppo/core_algos.py, the policy losses' pg_metrics)
CLIPFRAC = "actor/pg_clipfrac"
CLIPFRAC_LOWER = "actor/pg_clipfrac_lower"
PPO_KL = "actor/ppo_kl"


@dataclass(frozen=True)
class LossMatrix:
    """A policy loss per token, before aggregation: ``loss`` [B, R] (masked tokens are ignored);
    ``metrics``, verl's name -> per-token values [B, R] reported as their mean over ``metric_mask`` (the
    response ``mask`` when None); ``extra``, more per-token metrics, always over the response ``mask``."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]
    metric_mask: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class PolicyLossOptions:
    """A policy loss's options, verl's actor keys with verl's defaults (verl/workers/config/actor.py:
    ``ActorConfig``, ``PolicyLossConfig``, ``RolloutCorrectionConfig``). ``clip_ratio_low`` and
    ``clip_ratio_high`` default to ``clip_ratio`` (for DPPO they are divergence thresholds);
    ``clip_ratio_c`` None turns the dual clip off; ``loss_scale_factor`` is seq-mean-token-sum-norm's
    normaliser (the response width when None)."""

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float | None = 3.0
    loss_scale_factor: int | None = None
    tau_pos: float = 1.0  # SAPO's gate temperature for A > 0
    tau_neg: float = 1.05  # ... and for A ≤ 0
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    dro_beta: float | None = None  # required by dro
    # bypass_mode's rollout correction (verl's policy_loss.rollout_correction.*)
    loss_type: str = "ppo_clip"  # or reinforce
    rollout_is: str | None = None  # token, sequence, or None: no IS weight
    rollout_is_threshold: float | str = 2.0  # upper (TIS clamp) or "lower_upper" (IcePop: zero outside)
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None  # rejection: comma-separated token_k1.., seq_sum_k.., seq_mean_k.., seq_max_k..
    rollout_rs_threshold: float | str | None = None

    @property
    def low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high

    @classmethod
    def of(cls, options: Mapping[str, object]) -> PolicyLossOptions:
        """The options from verl's keys: flat, or nested as verl's ``policy_loss`` and
        ``policy_loss.rollout_correction`` sections; an unknown key is refused with the known ones."""
        flat = dict(options)
        for section in ("policy_loss", "rollout_correction"):
            nested = flat.pop(section, None) or {}
            flat |= dict(nested)
            flat |= dict(flat.pop("rollout_correction", None) or {})
        flat.pop("loss_mode", None)
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(flat) - set(known))
        if unknown:
            raise ValueError(f"unknown policy-loss option(s) {unknown}; known: {known}")
        return cls(**flat)
