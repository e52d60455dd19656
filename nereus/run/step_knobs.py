"""Per-run training state the RL step keeps between steps under verl's keys: the in-reward KL coefficient
(``run.kl_ctrl``, ``rl.kl_control``) and the critic-only warm-up steps (``run.critic_warmup``)."""

from __future__ import annotations

import math
from typing import TypeVar

from nereus.rl.kl_control import KLController, reward_kl
from nereus.run.inference import Inferred
from nereus.run.rollout import Rollout
from nereus.spec.errors import SpecError
from nereus.spec.job import JobSpec
from nereus.spec.run_train_knobs import actor_updates_at

T = TypeVar("T")


class RewardKL:
    """The KL penalty in the reward of ``job`` across steps: β for each step (``begin``), then the batch's
    KL measured and β adapted (``end``), as verl's ``apply_kl_penalty``; checkpointed with the run."""

    def __init__(self, job: JobSpec) -> None:
        r = job.run
        self.in_reward = bool(r.kl_coef) and not r.use_kl_loss
        self.kl_penalty = r.kl_penalty
        self.ctrl = KLController(r.kl_coef, r.kl_ctrl.type, r.kl_ctrl.target_kl, r.kl_ctrl.horizon)

    def begin(self, step: int) -> float:
        """β of step ``step`` (a step redone after a recovery gets the β it first had)."""
        return self.ctrl.begin(step)

    def end(self, roll: Rollout, inf: Inferred, beta: float) -> dict[str, float]:
        """After the step's advantages used ``beta``: adapt β to the batch's KL (its responses counted as
        the controller's steps, as verl's batch size) and return verl's ``actor/reward_kl_penalty`` (that
        KL) and ``actor/reward_kl_penalty_coeff`` (``beta``); nothing when the KL is not in the reward."""
        if not self.in_reward or inf.ref_logp is None:
            return {}
        kl = reward_kl(inf.old_logp, inf.ref_logp, roll.mask, self.kl_penalty)
        self.ctrl.update(kl, int(roll.mask.shape[0]))
        return {"actor/reward_kl_penalty": kl, "actor/reward_kl_penalty_coeff": beta}

    def state_dict(self) -> dict[str, float]:
        return self.ctrl.state_dict()

    def load_state_dict(self, state: dict[str, float]) -> None:
        """β from a checkpoint's ``state.json`` (``kl_ctrl``); a malformed entry is refused by name."""
        value = state.get("kl_coef") if isinstance(state, dict) else None
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise SpecError("--resume", f"state.json's kl_ctrl holds {str(state)[:60]!r}, not a KL coefficient "
                                        "({\"kl_coef\": a number >= 0}): the checkpoint is inconsistent")
        self.ctrl.load_state_dict(state)


def warmup_jobs(job: JobSpec, step: int, jobs: dict[str, T]) -> dict[str, T]:
    """The step's training jobs without the actor's during ``run.critic_warmup`` (verl trains only the
    critic while ``critic_warmup`` > its 1-based global step)."""
    if actor_updates_at(job.run.critic_warmup, step):
        return jobs
    return {model: j for model, j in jobs.items() if model != "actor"}
