"""Training knobs of the ``run:`` section under verl's names: the in-reward KL controller (``run.kl_ctrl``),
the learning-rate schedule (``run.lr_scheduler_type``, ``min_lr_ratio``, ``num_cycles``), top-k sampling
(``run.top_k``) and critic-only warm-up steps (``run.critic_warmup``). Each reader takes the ``run``
section's ``Fields`` and returns a typed value ``RunSpec`` keeps."""

from __future__ import annotations

import math
from dataclasses import dataclass

from nereus.spec.errors import SpecError
from nereus.spec.fields import MAX_STEPS, Fields
from nereus.spec.layout import ModelStage

# verl's algorithm.kl_ctrl.type: a fixed in-reward coefficient, or Ziegler et al.'s adaptive controller
KL_CTRL_TYPES = ("fixed", "adaptive")
# verl's optim.lr_scheduler_type (optim.warmup_style is its older name)
LR_SCHEDULER_TYPES = ("constant", "cosine")


@dataclass(frozen=True)
class KlCtrlSpec:
    """``run.kl_ctrl``: how the in-reward KL coefficient ``run.kl_coef`` evolves (``nereus.rl.kl_control``).
    ``target_kl`` and ``horizon`` are read by the adaptive controller only; defaults are verl's."""

    type: str = "fixed"
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass(frozen=True)
class LrScheduleSpec:
    """``run.lr_scheduler_type`` with ``min_lr_ratio`` and ``num_cycles`` (cosine only); the warm-up is
    ``run.lr_warmup_steps`` / ``lr_warmup_steps_ratio`` for either type, as in verl."""

    type: str = "constant"
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5

    def ratio(self, step: int, warmup: int, total: int) -> float:
        """The share of the base rate at 0-based update ``step``: linear warm-up over ``warmup`` updates
        (from 0, so the first update runs at 0 as verl's), then constant, or cosine decay over the rest of
        ``total`` updates to ``min_lr_ratio`` — verl's ``get_cosine_schedule_with_warmup`` (SGDR's cosine
        annealing, Loshchilov & Hutter 2017, arXiv:1608.03983): with progress p ∈ [0, 1] past the warm-up,
        max(m, m + (1 − m)·½·(1 + cos(2π·num_cycles·p)))."""
        if step < warmup:
            return step / max(1, warmup)
        if self.type == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        m = self.min_lr_ratio
        return max(m, m + (1 - m) * 0.5 * (1 + math.cos(2 * math.pi * self.num_cycles * progress)))


def read_kl_ctrl(f: Fields) -> KlCtrlSpec:
    """``run.kl_ctrl``: ``type`` (fixed, adaptive), ``target_kl`` and ``horizon`` (both > 0 when adaptive)."""
    k = f.sub("kl_ctrl")
    spec = KlCtrlSpec(type=k.get("type", str, "fixed", choices=KL_CTRL_TYPES),
                      target_kl=k.get("target_kl", float, 0.1), horizon=k.get("horizon", int, 10000))
    k.finish()
    if spec.type == "adaptive":
        if not spec.target_kl > 0:
            raise SpecError(k.key_path("target_kl"), f"{spec.target_kl}: the adaptive controller divides by it; "
                                                     "give a KL above 0 (verl's default is 0.1)")
        if spec.horizon <= 0:
            raise SpecError(k.key_path("horizon"), f"{spec.horizon}: the adaptive controller divides by it; give "
                                                   "at least 1 (verl's default is 10000)")
    return spec


def read_lr_schedule(f: Fields) -> LrScheduleSpec:
    """``run.lr_scheduler_type`` (constant, cosine), ``run.min_lr_ratio`` in [0, 1], ``run.num_cycles``."""
    return LrScheduleSpec(type=f.get("lr_scheduler_type", str, "constant", choices=LR_SCHEDULER_TYPES),
                          min_lr_ratio=f.get("min_lr_ratio", float, 0.0, minimum=0, maximum=1),
                          num_cycles=f.get("num_cycles", float, 0.5, minimum=0))


def read_top_k(f: Fields) -> int:
    """``run.top_k``: sample among the k most likely tokens; -1 (verl's default for vLLM) or 0: off."""
    return f.get("top_k", int, -1, minimum=-1)


def read_critic_warmup(f: Fields, stages: list[ModelStage]) -> int:
    """``run.critic_warmup``: verl's ``trainer.critic_warmup``; refused above 0 without a critic to train."""
    n = f.get("critic_warmup", int, 0, minimum=0, maximum=MAX_STEPS)
    if n > 0 and ModelStage("critic", "training") not in stages:
        raise SpecError(f.key_path("critic_warmup"), f"{n}: warm-up steps train only the critic, and this job has "
                                                     "none; remove the key (or set it to 0) or add a critic")
    return n


def actor_updates_at(critic_warmup: int, step: int) -> bool:
    """Whether the actor trains at 0-based step ``step``: verl's ``critic_warmup <= global_steps`` with its
    global step counted from 1, so ``critic_warmup`` N leaves the actor untouched for the first N − 1 steps."""
    return critic_warmup <= step + 1


def actor_updates_before(critic_warmup: int, step: int) -> int:
    """How many actor updates ran before 0-based step ``step``: the actor's learning-rate schedule advances
    only when it trains (verl steps each model's scheduler with its own update)."""
    return max(0, step - max(0, critic_warmup - 1))
