"""The RL step's training: advantages from the inference (``rl.core``), each trained model's batch and loss
(``rl.losses``), and ``epochs`` × ``mini_batches`` optimizer steps on its training layout, whose
statistics come back typed (``ModelUpdate``).

Sequentially each optimizer step is answered before the next is issued and the critic trains before the
actor; with ``run.overlap`` every optimizer step of both models is issued at once (each worker runs its
calls in order either way), so models trained on disjoint workers train at the same time.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from nereus.rl import losses
from nereus.rl.core import AdvantageInputs, advantage_estimator
from nereus.rl.data import Prompt
from nereus.run.inference import Inferred
from nereus.run.overlap import Call, Calls
from nereus.run.rollout import Rollout, draw_uids, mini_batches
from nereus.run.setup import MINI_BATCH_ORDER
from nereus.run.stage_keys import StageKeys
from nereus.run.step_clock import StepClock
from nereus.runtime.cluster.calls import TrainStep
from nereus.runtime.engines.sampling import derive_seed
from nereus.runtime.parallel.batch import TrainBatch
from nereus.runtime.parallel.sharded import LossFn, TrainStats
from nereus.spec.job import JobSpec


@dataclass(frozen=True)
class TrainingJob:
    """One model's update: its batch, loss function and base learning rate."""

    batch: TrainBatch
    loss_fn: LossFn
    lr: float


@dataclass(frozen=True)
class MicroStats:
    """One micro-batch's statistics of a model's update: the index of its optimizer step within the step,
    and what the loss function reported (``rl.losses.ActorLossStats``, ``CriticLossStats``)."""

    update: int
    loss: losses.ActorLossStats | losses.CriticLossStats


@dataclass(frozen=True)
class ModelUpdate:
    """A model's optimizer steps in the step: every micro-batch's statistics (replica-major, the order
    they are summed in) and the mean global gradient norm before clipping (None without clipping)."""

    stats: list[MicroStats]
    grad_norm: float | None = None


def advantages(job: JobSpec, roll: Rollout, rows: list[Prompt], inf: Inferred,
               kl_coef: float | None = None) -> dict[str, torch.Tensor]:
    """The estimator's output (``rl.core.advantage_estimator``: ``adv``, ``returns``, ...) for the step's
    rollout ``roll`` of ``rows`` (a GRPO group per draw, ``draw_uids``); ``kl_coef``: the in-reward KL
    coefficient of the step (``run.kl_ctrl``'s, ``run.step_knobs``), else ``run.kl_coef``."""
    r = job.run
    x = AdvantageInputs(
        scores=inf.score, mask=roll.mask, groups=draw_uids(len(rows), job.algorithm.samples_per_prompt),
        old_logp=inf.old_logp, values=inf.values,
        # the KL is a reward penalty only when it is not a loss term
        ref_logp=None if r.use_kl_loss else inf.ref_logp, kl_penalty=r.kl_penalty,
        kl_coef=r.kl_coef if kl_coef is None else kl_coef, gamma=r.gamma, lam=r.lam,
        norm_adv_by_std=r.norm_adv_by_std_in_grpo, baseline_scores=inf.baseline_score,
        sum_pi_squared=inf.sum_pi_squared)
    return advantage_estimator(job.algorithm.adv_estimator)(x)


def training_jobs(job: JobSpec, roll: Rollout, inf: Inferred, adv: dict[str, torch.Tensor]) -> dict[str, TrainingJob]:
    """model -> its update, critic first."""
    r, mask = job.run, roll.mask
    out = {}
    if "critic" in job.algorithm.models:
        batch = TrainBatch(roll.tokens, roll.index, mask, old_values=inf.values, returns=adv["returns"],
                           lengths=roll.lengths)
        out["critic"] = TrainingJob(batch, partial(losses.critic_loss, clip=r.value_clip), r.critic_lr)
    kl_coef = r.kl_loss_coef if r.use_kl_loss and inf.ref_logp is not None else 0.0
    batch = TrainBatch(roll.tokens, roll.index, mask, old_logp=inf.old_logp, advantages=adv["adv"],
                       ref_logp=inf.ref_logp if kl_coef else None, lengths=roll.lengths, routes=roll.routes)
    # verl: clip_ratio_low and clip_ratio_high each default to clip_ratio
    low = r.clip_ratio if r.clip_ratio_low is None else r.clip_ratio_low
    high = r.clip_ratio if r.clip_ratio_high is None else r.clip_ratio_high
    loss = losses.policy_loss(clip_low=low, clip_high=high, kl_loss_coef=kl_coef, kl_loss_type=r.kl_loss_type,
                              clip_ratio_c=r.clip_ratio_c, entropy_coeff=r.entropy_coeff,
                              loss_mode=r.policy_loss.loss_mode, loss_options=r.policy_loss.options(),
                              loss_agg_mode=r.loss_agg_mode)
    out["actor"] = TrainingJob(batch, loss, r.actor_lr)
    return out


class StepTraining:
    """The optimizer steps of ``job``'s models on the training layouts ``keys`` names, issued through
    ``calls`` and timed on ``clock`` (``timing_s/update_<model>``)."""

    def __init__(self, job: JobSpec, keys: StageKeys, calls: Calls, clock: StepClock) -> None:
        self.job, self.run, self.alg = job, job.run, job.algorithm
        self.keys, self.calls, self.clock = keys, calls, clock

    def train(self, step: int, jobs: dict[str, TrainingJob]) -> dict[str, ModelUpdate]:
        """Every model's update: one after the other, or (``run.overlap``) all their optimizer steps issued
        together, so a critic and an actor trained on disjoint workers train at the same time."""
        if not self.run.overlap:
            out = {}
            for model, j in jobs.items():
                with self.clock.timer(f"update_{model}"):
                    out[model] = self.update(model, j.batch, j.loss_fn, j.lr, step)
            return out
        issued = {model: self.submit_update(model, j.batch, j.loss_fn, j.lr, step) for model, j in jobs.items()}
        out = {model: self.update_stats(model, calls) for model, calls in issued.items()}
        for model, calls in issued.items():
            self.clock.set(f"update_{model}", sum(self.calls.seconds(c) for c in calls))
        return out

    def update(self, model: str, batch: TrainBatch, loss_fn: LossFn, lr: float, step: int) -> ModelUpdate:
        """``epochs`` × ``mini_batches`` optimizer steps on ``model``'s training layout."""
        return self.update_stats(model, self.submit_update(model, batch, loss_fn, lr, step))

    def submit_update(self, model: str, batch: TrainBatch, loss_fn: LossFn, lr: float, step: int) -> list[Call]:
        """Issue ``model``'s optimizer steps; sequentially each is answered before the next is issued,
        with ``run.overlap`` all are issued at once (the worker runs them in order either way). ``lr`` is
        the base rate, scaled by the schedule (``RunSpec.lr_at``)."""
        key = self.keys[model, "training"]
        lr = self.run.lr_at(lr, step, model)
        gen = torch.Generator().manual_seed(derive_seed(self.run.seed, MINI_BATCH_ORDER, step))
        horizon = self.run.max_response_length(step, self.job.workload.response.max)
        parts = [mb for _ in range(self.alg.epochs)
                 for mb in mini_batches(batch, self.alg.mini_batches, gen, self.run.loss_agg_mode, horizon,
                                        getattr(loss_fn, "pg_agg_mode", None))]
        calls = []
        for mb in parts:
            calls.append(self.calls.submit(f"update_{model}", "train", key, TrainStep(
                mb, loss_fn, lr, self.run.grad_clip or None, self.run.weight_decay)))
            if not self.run.overlap:
                self.calls.wait(calls[-1:])
        return calls

    def update_stats(self, model: str, calls: list[Call]) -> ModelUpdate:
        """The statistics of ``model``'s optimizer steps ``calls``: one record per micro-batch, each with
        ``update``, the index of its optimizer step in the step (the last mini-batch's are the last ones,
        ``report.step_metrics``), and the gradient norm, measured while clipping (verl's
        ``actor/grad_norm``, ``critic/grad_norm``)."""
        steps = [TrainStats(tuple(parts)) for parts in self.calls.wait(calls)]
        replicas = range(len(steps[0].replicas))  # replica-major, as the statistics have always been summed
        norm = None
        if self.run.grad_clip:
            norms = [st.replicas[d].grad_norm for d in replicas for st in steps]
            norm = sum(norms) / len(norms)
        return ModelUpdate([MicroStats(i, m) for d in replicas for i, st in enumerate(steps)
                            for m in st.replicas[d].metrics], norm)
