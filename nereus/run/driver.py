"""The PPO/GRPO step on the runtime, each model-stage under its own layout (verl's dataflow):

generation (actor) → inference (actor old log-probs, reference log-probs, critic values, reward-model
scores + rule-based reward) → advantages (GAE for PPO, group-normalised for GRPO) → training (critic:
clipped value loss; actor: clipped policy loss with a KL penalty in the reward or a KL loss), ``epochs``
× ``mini_batches`` optimizer updates → weight sync from each trained model's training layout to its other
layouts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from nereus.control.backend import GenerationPolicy
from nereus.rl.data import Prompt
from nereus.rl.rewards import RewardRouter
from nereus.rl.tokenizer import Tokenizer
from nereus.run.asyncmode import AsyncRollouts
from nereus.run.draws import PromptDraws
from nereus.run.dynamic_sampling import DynamicSampling
from nereus.run.generated import DECODE_METRICS, Generated
from nereus.run.generation import StepGeneration
from nereus.run.greedy_baseline import with_greedy_baseline
from nereus.run.inference import Inferred, StepInference
from nereus.run.midstep import METRICS
from nereus.run.overlap import Calls
from nereus.run.report import step_metrics
from nereus.run.rollout import Rollout
from nereus.run.setup import Placed
from nereus.run.stage_keys import StageKeys
from nereus.run.step_clock import StepClock
from nereus.run.step_knobs import RewardKL, warmup_jobs
from nereus.run.training import ModelUpdate, StepTraining, advantages, training_jobs
from nereus.runtime.cluster.workers import Runtime
from nereus.runtime.engines.protocol import EngineConfig, EnginesOpened
from nereus.spec.generation import GenerationEntry
from nereus.spec.job import JobSpec
from nereus.spec.levers import GenerationLevers


@dataclass(frozen=True)
class StepRun:
    """One RL step's results for the backend: its metric line, the decisions the policy took inside its
    generation, and every trained response's length (a prompt's group consecutive; empty where the step
    does not say: asynchronous steps)."""

    metrics: dict[str, float]
    generation: tuple[GenerationEntry, ...] = ()
    response_lengths: tuple[float, ...] = ()


class RLStep:
    """One PPO/GRPO step of ``job`` on runtime ``rt`` whose models are loaded under ``placed``: the step's
    generation (``StepGeneration``), inference (``StepInference``), advantages and training
    (``run.training``) and weight sync, in that order (with ``run.async``, generation one step ahead:
    ``async_step``), and its metric line (``run.report``). The pieces share where the models are
    (``keys``), the step's worker calls (``calls``) and its timings (``clock``)."""

    def __init__(self, job: JobSpec, rt: Runtime, placed: list[Placed], tok: Tokenizer,
                 train: list[Prompt], reward: RewardRouter | None = None) -> None:
        self.job, self.rt, self.run = job, rt, job.run
        self.keys = StageKeys(placed)
        self.calls = Calls(rt)  # the step's worker calls: futures and per-worker busy time
        self.clock = StepClock()
        draws = PromptDraws(train, job.workload.prompts_per_step, job.run.seed)
        self.generation = StepGeneration(job, rt, self.keys, self.calls, self.clock, tok, draws)
        self.inference = StepInference(job, self.keys, self.calls, self.clock, tok,
                                       reward or RewardRouter(job.run.rule_reward, job.run.reward_function))
        self.training = StepTraining(job, self.keys, self.calls, self.clock)
        self.asynchronous = AsyncRollouts(job.run, self.keys, self.generation, self.calls, self.clock
                                          ) if job.run.async_mode.on else None  # run.async (run.asyncmode)
        self.sampling = DynamicSampling(self.generation, self.inference) if job.run.filter_groups.enable else None
        self.reward_kl = RewardKL(job)  # run.kl_ctrl: the in-reward KL coefficient, step to step (checkpointed)

    def use(self, placed: list[Placed]) -> None:
        """The models are now loaded under ``placed`` (after a transition or a recovery)."""
        self.keys.use(placed)

    @property
    def key(self) -> dict[tuple[str, str], str]:
        """The runtime key of each (model, stage)."""
        return self.keys.keys

    @property
    def timing(self) -> dict[str, float]:
        """The step's ``timing_s/*`` so far."""
        return self.clock.timing

    def has(self, model: str) -> bool:
        return model in self.job.algorithm.models

    def open_engine(self) -> EnginesOpened | None:
        """With an engine opened per replica (``EngineTraits.restarts_on_move``: vLLM, one per replica of the
        layout's TP size, loaded with its weights): the actor's generation key's engines (at the start, and
        again after a transition moved the key or a recovery re-formed the layout); the engines started and
        reused (None for an engine that generates from the workers' shards)."""
        traits = self.run.rollout_engine.traits
        if not traits.restarts_on_move:
            return None
        key = self.key["actor", "generation"]
        w = self.job.workload
        return self.rt.open_engine(key, EngineConfig(self.rt.specs[key].cfg, w.prompt_length + w.response.max,
                                                     max_num_seqs=traits.slots(self.run.rollout_slots),
                                                     dtype=self.rt.specs[key].dtype, seed=self.run.seed,
                                                     settings=self.run.rollout_engine,
                                                     tp=self.rt.specs[key].layout.tp))


    def generate(self, step: int, prompts: list[Prompt], policy: GenerationPolicy | None = None,
                 levers: GenerationLevers | None = None) -> Generated:
        """Step ``step``'s generation of ``prompts`` (``StepGeneration.generate``), with the inference stages
        that may start on its finished replicas' rows."""
        return self.generation.generate(step, prompts, policy, levers, tuple(self.inference.stages()))

    def sync(self, trained: dict[str, ModelUpdate] | None = None) -> None:
        """Each trained model's new weights (of those in ``trained``, else every one) from its training layout
        to its other layouts, by the live transition executor (``Runtime.sync_weights``): shards that coincide
        on a worker are shared, the rest move point to point between workers."""
        with self.clock.timer("update_weights"):  # verl's name for the trainer -> rollout weight update
            for model in ("actor", "critic"):
                if self.has(model) and (trained is None or model in trained):
                    self.rt.sync_weights(model, self.job)
            # then into the engines' own copy, in place
            if self.run.rollout_engine.traits.own_weights and (trained is None or "actor" in trained):
                self.timing["timing_s/update_weights_engine"] = self.rt.update_engine(self.key["actor", "generation"])

    def step(self, step: int, policy: GenerationPolicy | None = None) -> dict[str, float]:
        """One RL step; its metric line."""
        return self.run_step(step, policy).metrics

    def run_step(self, step: int, policy: GenerationPolicy | None = None,
                 levers: GenerationLevers | None = None) -> StepRun:
        """One RL step under the plan's ``levers``: its metric line, the decisions ``policy`` took inside its
        generation, and its responses' lengths."""
        if self.asynchronous is not None and self.asynchronous.enabled:  # run.async: generation one step ahead
            return StepRun(self.async_step(step))
        self.clock.reset()
        self.calls.reset()
        t0 = time.perf_counter()
        gen = self.sampling.generate(step, policy, levers) if self.sampling is not None else self.generate(
            step, self.generation.prompts(step), policy, levers)  # run.filter_groups: DAPO's dynamic sampling
        roll, rows = gen.rollout, gen.rows
        inf = with_greedy_baseline(self.job, step, rows, self.inference.infer(roll, rows, gen.early), self.generation,
                                   self.inference)  # ReMax
        with self.clock.timer("adv"):
            beta = self.reward_kl.begin(step)
            adv = advantages(self.job, roll, rows, inf, beta)
            kl = self.reward_kl.end(roll, inf, beta)
        trained = self.training.train(step, warmup_jobs(self.job, step, training_jobs(self.job, roll, inf, adv)))
        self.sync(trained)
        self.clock.set("step", time.perf_counter() - t0)
        m = self.metrics(step, roll, inf, adv, trained) | kl
        zeros = dict.fromkeys(DECODE_METRICS + (METRICS if self.run.rollout_midstep is not None else ()), 0.0)
        m.update(zeros | gen.metrics)  # zeros for what a step generated otherwise does not measure
        m.update(self.worker_metrics())
        if self.asynchronous is not None:  # run.async auto: decides from the synchronous steps' times
            self.asynchronous.observe(step, m)
        return StepRun(m, gen.entries, tuple(float(x) for x in roll.response_len.tolist()))

    def async_step(self, step: int) -> dict[str, float]:
        """One asynchronous step (``run.asyncmode``'s steps 1-4): this step's rollout, generated during the
        previous step where it can be; the next step's generation issued before this step's inference and
        training, collected before its weight sync. The metric line adds ``async/*`` and ``rollout_corr/*``."""
        mode = self.asynchronous
        self.clock.reset()
        self.calls.reset()
        t0 = time.perf_counter()
        try:
            gen, version = mode.rollout(step, lambda s: self.generate(s, self.generation.prompts(s)))
            roll, rows = gen.rollout, gen.rows
            if mode.ahead(step):
                mode.issue(step + 1, version=step)
            inf = with_greedy_baseline(self.job, step, rows, self.inference.infer(roll, rows, gen.early),
                                       self.generation, self.inference)  # ReMax
            with self.clock.timer("adv"):
                beta = self.reward_kl.begin(step)
                adv = advantages(self.job, roll, rows, inf, beta)
                kl = self.reward_kl.end(roll, inf, beta)
            jobs = training_jobs(self.job, roll, inf, adv)
            batch, corr = mode.correct(roll, inf.old_logp, jobs["actor"].batch)
            jobs["actor"] = replace(jobs["actor"], batch=batch)
            trained = self.training.train(step, warmup_jobs(self.job, step, jobs))
            mode.events.append(("training_answered", step))
            if mode.pending is not None:
                mode.collect()
            self.sync(trained)
        except BaseException:
            mode.pending = None  # a failed step (a lost worker): its queued rollout is not used
            raise
        self.clock.set("step", time.perf_counter() - t0)
        m = self.metrics(step, roll, inf, adv, trained) | kl
        m.update(self.worker_metrics())
        m.update(corr)
        m.update(mode.staleness(step, torch.full((len(rows),), version)))
        return m

    def metrics(self, step: int, roll: Rollout, inf: Inferred, adv: dict[str, torch.Tensor],
                trained: dict[str, ModelUpdate]) -> dict[str, float]:
        """verl's metric names (``critic/score/mean``, ``actor/pg_loss``, ``response_length/mean``...)."""
        return step_metrics(self.job, step, roll, inf, adv, trained, self.clock.timing)

    def worker_metrics(self) -> dict[str, float]:
        """Each worker's busy and idle time in the step (``Calls.worker_metrics``)."""
        return self.calls.worker_metrics(len(self.rt.workers), self.clock.seconds("step"),
                                         self.clock.seconds("update_weights"))
