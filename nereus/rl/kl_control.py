"""The in-reward KL coefficient β over a run (verl's ``algorithm.kl_ctrl``): fixed, or adapted toward a
target KL by Ziegler et al.'s proportional controller (arXiv:1909.08593, §2.2).

The controller's state is one number per step (the β the step started with), so a step redone after a
recovery starts from the β it first started with, and a checkpoint holds the β of the next step."""

from __future__ import annotations

import torch

from nereus.rl.core import kl_estimate, masked_mean

# Ziegler et al.'s clip of the proportional error: β moves by at most 20% of n_steps / horizon per update
MAX_ERROR = 0.2


def adaptive_kl_coef(coef: float, current_kl: float, n_steps: int, target_kl: float, horizon: int) -> float:
    """β after one update (Ziegler et al. 2019, arXiv:1909.08593, §2.2): e = clip(KL / target − 1, −0.2, 0.2),
    β ← β·(1 + e·n_steps / horizon), where ``n_steps`` counts the samples the KL was measured on (verl: the
    batch's responses)."""
    error = min(max(current_kl / target_kl - 1.0, -MAX_ERROR), MAX_ERROR)
    return coef * (1.0 + error * n_steps / horizon)


def reward_kl(old_logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, kind: str) -> float:
    """The batch's KL as verl's ``apply_kl_penalty`` measures it for the controller (and logs it as
    ``actor/reward_kl_penalty``): the per-token estimate ``kind`` of the rollout policy against the
    reference [B, R], its token mean per response, then the mean over responses."""
    return float(masked_mean(kl_estimate(old_logp, ref_logp, kind), mask, dim=-1).mean())


class KLController:
    """β of the in-reward KL penalty, step by step: ``kind`` fixed (β stays ``coef``) or adaptive
    (``adaptive_kl_coef`` toward ``target_kl`` over ``horizon`` samples)."""

    def __init__(self, coef: float, kind: str = "fixed", target_kl: float = 0.1, horizon: int = 10000) -> None:
        if kind not in ("fixed", "adaptive"):
            raise ValueError(f"unknown KL controller {kind!r}; choose one of ['fixed', 'adaptive']")
        if kind == "adaptive" and (target_kl <= 0 or horizon <= 0):
            raise ValueError(f"the adaptive KL controller needs target_kl > 0 and horizon > 0, got {target_kl}, "
                             f"{horizon}")
        self.kind, self.target_kl, self.horizon = kind, target_kl, horizon
        self.value = coef
        self._started: dict[int, float] = {}  # step -> the β it started with

    def begin(self, step: int) -> float:
        """β for step ``step``: the current one, or, for a step started before (redone after a recovery),
        the one it started with then — later steps' updates are forgotten."""
        if step in self._started:
            self.value = self._started[step]
            self._started = {s: v for s, v in self._started.items() if s <= step}
        self._started[step] = self.value
        return self.value

    def update(self, current_kl: float, n_steps: int) -> None:
        """After a step: adapt β to the KL ``current_kl`` measured on ``n_steps`` responses (fixed: no-op)."""
        if self.kind == "adaptive":
            self.value = adaptive_kl_coef(self.value, current_kl, n_steps, self.target_kl, self.horizon)

    def state_dict(self) -> dict[str, float]:
        """What a checkpoint keeps: the β the next step starts with."""
        return {"kl_coef": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["kl_coef"])
        self._started = {}
