"""The simulator backend: steps and transitions on a virtual cluster with a hidden ground truth.

Ground truth is the cost model with hidden per-term efficiencies (one factor per stage kind and term,
log-normally spread around 1), per-step noise, and response lengths drawn per step from the trace's
long-tailed distribution — so generation time follows the longest response actually drawn. The policy
sees only the measured times, as on real hardware, and must calibrate to predict well.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from nereus.control.backend import ClusterState, GenerationPolicy, StepMetrics, TransitionMetrics
from nereus.control.transition_cost import TransitionCoster
from nereus.cost.batching import Factors
from nereus.cost.generation import GenModel, inference_gpus, no_move, overlapped_inference, run_bulk, with_tail
from nereus.cost.hardware import Hardware
from nereus.cost.plan_cost import estimate_plan
from nereus.cost.stages import TERMS
from nereus.cost.transition import estimate_transition
from nereus.sim.generation import Look, entries_of, status_at, tail_outcome, walk
from nereus.sim.workload import batch_at
from nereus.spec.generation import ChangeTailLayout, GenerationEntry
from nereus.spec.job import JobSpec, ResponseLength
from nereus.spec.layout import STAGES, Plan
from nereus.spec.trace import Trace


@dataclass(frozen=True)
class TruthConfig:
    efficiency_spread: float = 0.25  # sigma of log hidden factors: most within 0.6–1.6× the model
    noise: float = 0.03  # per-step multiplicative noise on every measured time
    transition_spread: float = 0.3  # hidden factor on transition times
    # generation at sequence granularity (cost.generation, sim.generation): each drawn length decoded with
    # slots refilled and the tail drained, instead of the analytic bulk/tail form at the drawn mean and
    # longest; a step whose policy asks for a decision point inside the generation always runs this way
    sequence_level: bool = True


def hidden_factors(seed: int, cfg: TruthConfig) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    factors = {f"{s}.{t}": float(math.exp(rng.normal(0, cfg.efficiency_spread))) for s in STAGES for t in TERMS}
    factors["sync"] = float(math.exp(rng.normal(0, cfg.efficiency_spread)))
    factors["transition"] = float(math.exp(rng.normal(0, cfg.transition_spread)))
    return factors


class SimBackend:
    """Runs a plan's steps against the hidden truth. Every random draw comes from a generator seeded by
    (seed, step, purpose), so a seed reproduces a run and every policy sees the same lengths and noise
    at the same step, whatever it did before."""

    def __init__(self, job: JobSpec, trace: Trace, seed: int = 0, truth: TruthConfig | None = None,
                 initial_gpus: int | None = None, coster: TransitionCoster | None = None) -> None:
        self.job, self.truth = job, truth or TruthConfig()
        self.trace = trace.with_sampled_failures(seed)
        self.seed = seed
        self.coster = coster or TransitionCoster()
        self.factors = hidden_factors(seed, self.truth)
        self.initial_gpus = initial_gpus or job.cluster.num_gpus
        self._max_gpus = max([self.initial_gpus, *(n for _, n in trace.gpus)])
        self.full_job = job.with_gpus(self._max_gpus)
        self.hw = Hardware(self.full_job.cluster)
        self.last_generation: dict = {}  # the latest step's sequence-level generation (sim.step_timeline)

    def cluster(self, step: int) -> ClusterState:
        now = self.trace.gpus_at(step, self.initial_gpus)
        before = self.trace.gpus_at(step - 1, self.initial_gpus) if step > 0 else now
        lost = sum(n for s, n in self.trace.failures if s == step)
        return ClusterState(now, lost if now < before or lost else 0)

    def _rng(self, step: int, purpose: int) -> np.random.Generator:
        return np.random.default_rng((self.seed, step, purpose))

    def job_at(self, step: int) -> JobSpec:
        """The job as it runs at ``step``: its batch may follow the GPUs available then
        (``sim.workload.GrowingBatchJob``); a fixed batch is the same at every step."""
        return batch_at(self.full_job, self.trace.gpus_at(step, self.initial_gpus))

    def draw_lengths(self, step: int) -> np.ndarray:
        r = self.trace.response_at(step)
        n = self.job_at(step).sequences_per_step()
        mu = math.log(r.mean) - r.sigma**2 / 2
        return np.minimum(self._rng(step, 0).lognormal(mu, r.sigma, size=n), r.max)

    def run_step(self, plan: Plan, step: int, policy: GenerationPolicy) -> StepMetrics:
        lengths = self.draw_lengths(step)
        mean, longest = float(lengths.mean()), float(lengths.max())
        r = self.trace.response_at(step)
        # The drawn batch: its mean sets tokens, its longest response sets the rollout's iterations.
        drawn = ResponseLength(mean, max(1, math.ceil(longest)), "lognormal", r.sigma)
        job = self.job_at(step)
        est = estimate_plan(self.hw, job.with_response(drawn), plan, self.factors)
        rng = self._rng(step, 1)
        noise = {name: float(math.exp(rng.normal(0, self.truth.noise))) for name in sorted(est.stage_times)}
        stage_times = {name: t * noise[name] for name, t in est.stage_times.items()}
        phases = dict.fromkeys(STAGES, 0.0)
        for name in stage_times:  # a phase takes as long as its noisiest member draws
            stage = name.split("/")[1]
            phases[stage] = max(phases[stage], est.phase_times[stage] * noise[name])
        phases["weight_sync"] = est.phase_times["weight_sync"] * float(math.exp(rng.normal(0, self.truth.noise)))
        model = GenModel.of(self.hw, job, plan, est)
        status = status_at(model, None, step, "start", 0.0, 0, r.max, plan.generation)
        t0 = time.perf_counter()
        answer = policy.during_generation(status)
        start = Look(0.0, status, answer, time.perf_counter() - t0)
        detail, entries = {}, ()
        if self.truth.sequence_level or start.decision.acts or not start.decision.look.none:
            detail, entries = self._sequence_level(plan, step, model, lengths, noise, stage_times, phases,
                                                   policy, start)
        tokens = float(job.sequences_per_step() * (job.workload.prompt_length + mean))
        return StepMetrics(step, stage_times, phases, sum(phases.values()), mean, longest,
                           job.sequences_per_step(), tokens, max(est.device_peak_bytes), plan.num_gpus, detail,
                           entries)

    def _sequence_level(self, plan: Plan, step: int, model: GenModel, lengths: np.ndarray, noise: dict,
                        stage_times: dict, phases: dict, policy: GenerationPolicy,
                        start: Look) -> tuple[dict, tuple[GenerationEntry, ...]]:
        """Generation decoded sequence by sequence under the hidden factors (``cost.generation``), its
        decision points walked with the policy (``sim.generation``), the tail layout it switched to if it
        did, and inference overlapped on the GPUs its tail frees. Fills the stage and phase times in place;
        returns where the time went and the recorded decisions with their predicted and realised numbers."""
        moved_noise = float(math.exp(self._rng(step, 3).normal(0, self.truth.noise)))
        f = Factors.of(self.factors, self.factors["transition"] * moved_noise)
        bulk = run_bulk(model, lengths, f)
        base = no_move(model, bulk)
        looks = walk(policy, start, model, bulk, self.trace.response_at(step).max)
        act = looks[-1] if looks and isinstance(looks[-1].decision, ChangeTailLayout) else None
        phase = act.decision.phase if act else None
        inf_gpus = inference_gpus(plan)
        out = with_tail(model, bulk, phase, f, inf_gpus, act.t) if act else base
        gen_noise = noise["actor/generation"]
        stage_times["actor/generation"] = out.generation_s * gen_noise
        inference = phases["inference"]
        after, early = overlapped_inference(inference, out, len(lengths))
        phases["generation"], phases["inference"] = out.generation_s * gen_noise, after
        idle = out.idle_gpu_s - early * len(inf_gpus)
        self.last_generation = {"model": model, "outcome": out, "phase": phase, "noise": gen_noise,
                                "early_s": early, "phases": dict(phases)}  # for a step's timeline
        detail = {"generation": {"bulk_s": out.bulk_s, "migration_s": out.migration_s, "tail_s": out.tail_s,
                                 "idle_gpu_s": max(0.0, idle) * gen_noise, "overlap_s": early}}
        tail = None if act is None else tail_outcome(model, bulk, act, f, inf_gpus, base, out, gen_noise, inference,
                                                     after, self.hw.usable_bytes())
        return detail, entries_of(looks, tail)

    def apply_transition(self, old: Plan, new: Plan, step: int) -> TransitionMetrics:
        """The transition graph's schedule (shared, cached, with the controller's) under the hidden factor."""
        est = estimate_transition(self.hw, self.full_job, old, new)
        # bytes only: the hidden truth scales the bandwidth-bound schedule, and the fixed part the policy
        # fits on this coster must not feed back into the truth it is fitted to
        predicted = self.coster.scheduled(self.hw, self.full_job, old, new) if self.coster.use_graph else est.seconds
        if not math.isfinite(predicted):  # no live move fits: the sim charges the quick estimate instead
            predicted = est.seconds
        noise = float(math.exp(self._rng(step, 2).normal(0, self.truth.noise)))
        actual = predicted * self.factors["transition"] * noise
        return TransitionMetrics(actual, predicted, est.bytes_moved, {"moved": list(est.moved_model_stages)})
