"""The simulator backend: steps and transitions on a virtual cluster with a hidden ground truth.

Ground truth is the cost model with hidden per-term efficiencies (one factor per stage kind and term,
log-normally spread around 1), per-step noise, and response lengths drawn per step from the trace's
long-tailed distribution — so generation time follows the longest response actually drawn. The policy
sees only the measured times, as on real hardware, and must calibrate to predict well.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import numpy as np

from nereus.control.backend import ClusterState, GenerationPolicy, StepMetrics, TransitionMetrics
from nereus.control.pools import runs_one_step_off
from nereus.control.transition_cost import TransitionCoster
from nereus.cost.batching import Factors
from nereus.cost.generation import (
    ROLLOUT,
    BulkRun,
    GenModel,
    GenOutcome,
    inference_gpus,
    no_move,
    overlapped_inference,
    run_bulk,
    with_tail,
)
from nereus.cost.hardware import Hardware
from nereus.cost.plan_cost import estimate_plan
from nereus.cost.stages import TERMS
from nereus.cost.tail.spec_run import MODEL_FREE, with_speculation
from nereus.cost.tail.speculative import DraftKind, prior
from nereus.cost.transition import estimate_transition
from nereus.sim.carry import CarriedResponses, GenerationRound, plan_round
from nereus.sim.dynamic_sampling import draw_batches, one_batch, scale_generation
from nereus.sim.generation import Look, entries_of, status_at, tail_outcome, walk
from nereus.sim.groups import Deferred, ShortRound, draw_groups, stop_round
from nereus.sim.reality import Reality, apply_reality, gpu_slowness
from nereus.sim.workload import batch_at
from nereus.spec.generation import ChangeTailLayout, GenerationEntry, Outcome, SetSpeculation
from nereus.spec.job import JobSpec, ResponseLength
from nereus.spec.layout import STAGES, Plan
from nereus.spec.levers import Speculation
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
    # what real runs pay that the cost model does not price: the driver's pass and stragglers (sim.reality)
    reality: Reality = Reality()


def hidden_factors(seed: int, cfg: TruthConfig) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    factors = {f"{s}.{t}": float(math.exp(rng.normal(0, cfg.efficiency_spread))) for s in STAGES for t in TERMS}
    factors["sync"] = float(math.exp(rng.normal(0, cfg.efficiency_spread)))
    factors["transition"] = float(math.exp(rng.normal(0, cfg.transition_spread)))
    # An MoE stage's dispatch/combine all-to-all (``cost.moe``, term ``ep_comm``): the truth's own efficiency,
    # as routing skew and the fabric move it away from the cost model's stated EP imbalance. Drawn after
    # every other factor, so a dense job's truth is what it was.
    for s in STAGES:
        factors[f"{s}.ep_comm"] = float(math.exp(rng.normal(0, cfg.efficiency_spread)))
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
        self.slowness = gpu_slowness(seed, self._max_gpus, self.truth.reality.straggler_sigma)
        self.last_generation: dict = {}  # the latest step's sequence-level generation (sim.step_timeline)
        self.carried = CarriedResponses.none()  # responses a partial-rollout step left to the next (sim.carry)
        self.deferred = Deferred.none()  # prompts tail batching deferred to a long round (sim.groups)
        self._launched_z = np.zeros(0)  # the difficulty of the prompts launched this step
        self._short = ShortRound(0.0, np.zeros(0, bool))  # the latest short round's stop
        self._tail_round: dict[str, float] | None = None  # this step's tail-batching round, if it was one

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
        return self.draw_step(step)[0]

    def draw_step(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The step's response lengths and its prompts' difficulty Z (``sim.groups``): siblings alike with
        the trace's correlation; independent draws when it has none or groups have one response."""
        r = self.trace.response_at(step)
        job = self.job_at(step)
        n, g, rho = job.sequences_per_step(), job.algorithm.samples_per_prompt, self.trace.sibling_correlation
        rng = self._rng(step, 0)
        if rho > 0 and g > 1:
            z = rng.standard_normal(n // g)
            return draw_groups(rng, r, z, g, rho), z
        return np.minimum(rng.lognormal(r.mu, r.sigma, size=n), r.max), np.zeros(0)

    def _tail_batching(self, plan: Plan, step: int, lengths: np.ndarray, z: np.ndarray) -> tuple[np.ndarray, bool]:
        """Tail batching's round (``sim.groups``): a long round of ``P`` deferred prompts once as many wait
        (regenerated from scratch), else a short round over-launched ``f``-fold that keeps the first ``P``
        groups to end (True). Without the lever, or while partial rollout's carried responses finish (the
        policy switched levers), the drawn lengths."""
        tb = plan.levers.tail_batching if plan.levers is not None else None
        job = self.job_at(step)
        p, g = job.workload.prompts_per_step, job.algorithm.samples_per_prompt
        self._launched_z = z if len(z) else np.zeros(p)
        if tb is None or len(self.carried):
            return lengths, False
        r, rho = self.trace.response_at(step), self.trace.sibling_correlation
        if len(self.deferred) >= p:
            self._launched_z, self.deferred = self.deferred.z[:p], Deferred(self.deferred.z[p:])
            self._tail_round = _tail_round(True, p, p, len(self.deferred))
            return draw_groups(self._rng(step, 5), r, self._launched_z, g, rho), False
        extra = math.ceil((tb.over_launch - 1) * p)
        if extra < 1:
            return lengths, False
        more_z = self._rng(step, 6).standard_normal(extra)
        self._launched_z = np.concatenate([self._launched_z, more_z])
        return np.concatenate([lengths, draw_groups(self._rng(step, 7), r, more_z, g, rho)]), True

    def run_step(self, plan: Plan, step: int, policy: GenerationPolicy) -> StepMetrics:
        lengths, z = self.draw_step(step)
        self._tail_round = None
        lengths, short = self._tail_batching(plan, step, lengths, z)
        mean, longest = float(lengths.mean()), float(lengths.max())
        r = self.trace.response_at(step)
        # The drawn batch: its mean sets tokens, its longest response sets the rollout's iterations.
        drawn = ResponseLength(mean, max(1, math.ceil(longest)), "lognormal", r.sigma)
        job = self.job_at(step)
        keep_rate, job = job.workload.filter_keep_rate, one_batch(job)  # dynamic sampling: batches drawn below
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
        status = status_at(model, None, step, "start", 0.0, 0, r.max, plan.generation, plan.levers)
        t0 = time.perf_counter()
        answer = policy.during_generation(status)
        start = Look(0.0, status, answer, time.perf_counter() - t0)
        prompt = float(job.workload.prompt_length)
        tokens = float(job.sequences_per_step() * (prompt + mean))
        rnd = self._round(plan, lengths, prompt)
        if rnd is not None:  # the step trains the responses that end in it: the later stages scale with them
            trained = rnd.trained * prompt + float(rnd.trained_lengths.sum())
            _scale_later_stages(stage_times, phases, trained / tokens)
            tokens = trained
        detail, entries = {}, ()
        keep = (job.workload.prompts_per_step, job.algorithm.samples_per_prompt) if short else None
        if self.truth.sequence_level or start.decision.acts or not start.decision.look.none or rnd or short:
            gen_lengths, contexts = (lengths, None) if rnd is None else (rnd.lengths, rnd.contexts)
            detail, entries = self._sequence_level(plan, step, model, gen_lengths, noise, stage_times, phases,
                                                   policy, start, contexts, keep)
        if short:  # the step trains the groups the short round kept; the others wait for a long round
            kept = self._short.kept_sequences(keep[1])
            self.deferred = Deferred(np.concatenate([self.deferred.z, self._launched_z[~self._short.kept]]))
            self._tail_round = _tail_round(False, len(self._launched_z), keep[0], len(self.deferred))
            trained = float(kept.sum() * prompt + lengths[kept].sum())
            _scale_later_stages(stage_times, phases, trained / tokens)
            tokens = trained
        added = apply_reality(self.truth.reality, self.slowness, plan, job, r.max, stage_times, phases)
        if self.last_generation:  # the step's timeline: generation stretched by its slowest GPU, then the driver
            self.last_generation.update(phases=dict(phases), stretch=added.phase_factors.get("generation", 1.0),
                                        driver_s=added.driver_s)
        if keep_rate < 1:  # each generation batch is a stage call of its own: scaled with its driver pass
            detail = {**detail, **self._dynamic_sampling(step, keep_rate, job, stage_times, phases)}
        lag = (1.0,) if rnd is None else rnd.policy_lag
        step_s = sum(phases.values())
        rollout_gpus = len(plan.placement(ROLLOUT).gpus) if runs_one_step_off(plan) else None
        if rollout_gpus:  # generation of the next step overlaps this step's inference and training
            step_s = max(phases["generation"], phases["inference"] + phases["training"]) + phases["weight_sync"]
            lag = (0.0, 1.0)
        idle = detail["generation"]["idle_gpu_s"] if "generation" in detail else 0.0
        busy_generation, busy_rest = busy_gpu_seconds(plan.num_gpus, rollout_gpus, phases, idle)
        detail = {**detail, "busy_gpu_s": busy_generation + busy_rest, "busy_generation_gpu_s": busy_generation,
                  "driver_s": added.driver_s}
        if self._tail_round is not None:  # this step was one of tail batching's rounds (the record's ``tail``)
            detail["tail"] = self._tail_round
        return StepMetrics(step, stage_times, phases, step_s, mean, longest,
                           job.sequences_per_step(), tokens, max(est.device_peak_bytes), plan.num_gpus, detail,
                           entries, lag, plan.levers)


    def _dynamic_sampling(self, step: int, keep_rate: float, job: JobSpec, stage_times: dict[str, float],
                          phases: dict[str, float]) -> dict[str, float]:
        """Dynamic sampling: the step generates batches until it keeps its groups (``sim.dynamic_sampling``);
        generation scaled by the batches drawn, whose figures it returns for the step's detail."""
        drawn = draw_batches(self._rng(step, 8), keep_rate, job.workload.prompts_per_step)
        scale_generation(stage_times, phases, drawn.batches)
        return drawn.metrics()
    def _round(self, plan: Plan, lengths: np.ndarray, prompt: float) -> GenerationRound | None:
        """This step's partial-rollout round (``sim.carry``), None when nothing is budgeted or carried."""
        pr = plan.levers.partial_rollout if plan.levers is not None else None
        if pr is None and not len(self.carried):
            return None
        rnd = plan_round(lengths, self.carried, prompt, None if pr is None else pr.round_tokens)
        self.carried = rnd.carried_out
        return rnd

    def _sequence_level(self, plan: Plan, step: int, model: GenModel, lengths: np.ndarray, noise: dict,
                        stage_times: dict, phases: dict, policy: GenerationPolicy, start: Look,
                        contexts: np.ndarray | None = None,
                        keep: tuple[int, int] | None = None) -> tuple[dict, tuple[GenerationEntry, ...]]:
        """Generation decoded sequence by sequence under the hidden factors (``cost.generation``), its
        decision points walked with the policy (``sim.generation``), the tail layout it switched to if it
        did, and inference overlapped on the GPUs its tail frees. Fills the stage and phase times in place;
        returns where the time went and the recorded decisions with their predicted and realised numbers."""
        moved_noise = float(math.exp(self._rng(step, 3).normal(0, self.truth.noise)))
        f = Factors.of(self.factors, self.factors["transition"] * moved_noise)
        bulk = run_bulk(model, lengths, f, contexts)
        base = no_move(model, bulk)
        looks = walk(policy, start, model, bulk, self.trace.response_at(step).max)
        act = looks[-1] if looks and isinstance(looks[-1].decision, ChangeTailLayout) else None
        phase = act.decision.phase if act else None
        inf_gpus = inference_gpus(plan)
        out = with_tail(model, bulk, phase, f, inf_gpus, act.t) if act else base
        gen_noise = noise["actor/generation"]
        if keep is not None:  # a short round of tail batching: the engine stops once P groups have ended
            self._short = stop_round(bulk.finish_s, keep[1], keep[0])
            out = stopped(out, self._short.stop_s)
        spec = looks[-1] if looks and isinstance(looks[-1].decision, SetSpeculation) else None
        spec_outcome = None
        if spec is not None and spec.decision.speculation is not None:
            out, spec_outcome, finish = self._speculate(step, model, bulk, spec.decision.speculation, f, base,
                                                        gen_noise)
            if keep is not None and finish is not None:  # the short round stops as its groups end under speculation
                self._short = stop_round(finish, keep[1], keep[0])
                out = stopped(out, self._short.stop_s)
                # the gain of a short round is against the plain round stopped where its own groups end
                plain = stopped(base, stop_round(bulk.finish_s, keep[1], keep[0]).stop_s)
                spec_outcome = replace(spec_outcome, gain_s=(plain.generation_s - out.generation_s) * gen_noise)
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
        return detail, entries_of(looks, tail or spec_outcome)

    def alpha(self, draft: str, step: int) -> float:
        """The ground truth's per-token acceptance of ``draft`` drafts at ``step``: the trace's rate, else the
        kind's published prior (``cost.tail.speculative.PRIORS``)."""
        rate = self.trace.acceptance_at(draft, step)
        return rate if rate is not None else prior(DraftKind(draft)).alpha

    def _speculate(self, step: int, model: GenModel, bulk: BulkRun, spec: Speculation, f: Factors,
                   base: GenOutcome, gen_noise: float) -> tuple[GenOutcome, Outcome, np.ndarray | None]:
        """Speculation as the engine runs it: each replica switched on below the live-batch threshold, each
        sequence's iterations drawn from the trace's acceptance (``cost.tail.spec_run``), and each
        sequence's finish under it. Model-free drafts only; another kind is refused and the stage runs
        without."""
        if spec.draft not in MODEL_FREE:
            return base, Outcome(False, f"the simulator runs model-free drafts ({', '.join(MODEL_FREE)}), "
                                        f"not {spec.draft}"), None
        run = with_speculation(model, bulk, spec.draft_tokens, spec.live_at_most, self.alpha(spec.draft, step), f,
                               self._rng(step, 4))
        figures = {"accepted_tokens": run.accepted_tokens, "verifications": run.verifications,
                   "spec_tokens": run.spec_tokens, "switched": float(run.switched), "spec_s": run.spec_s * gen_noise}
        gain = (base.generation_s - run.outcome.generation_s) * gen_noise
        return run.outcome, Outcome(True, "", 0.0, gain, figures), run.finish_s

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


def _tail_round(long: bool, launched: int, kept: int, deferred: int) -> dict[str, float]:
    """A tail-batching round in groups, under the runtime's ``tail/*`` metric names: long (regenerating
    deferred prompts) or short, the groups launched and kept, and those waiting after it."""
    return {"long_round": float(long), "launched_groups": float(launched), "kept_groups": float(kept),
            "deferred_groups": float(deferred)}


def busy_gpu_seconds(num_gpus: int, rollout_gpus: int | None, phases: dict[str, float],
                     idle_generation_gpu_s: float) -> tuple[float, float]:
    """GPU-seconds a step's work holds, (generation's, the rest's): each phase's GPUs for its time (the
    rollout pool's ``rollout_gpus`` for generation and the others for inference and training when the plan
    runs one-step-off, every GPU when ``rollout_gpus`` is None), less the generation's idle ones; the
    weight sync holds every GPU and counts with the rest. Spread evenly over the plan's GPUs their sum is
    the step no schedule of this work beats (``RunRecord.summary``'s ``balanced_step_s``): what balancing
    alone could still gain; the split says which work a goal beyond it must shrink."""
    n = num_gpus
    gen_gpus, rest_gpus = (rollout_gpus, n - rollout_gpus) if rollout_gpus else (n, n)
    generation = gen_gpus * phases["generation"] - idle_generation_gpu_s
    return generation, rest_gpus * (phases["inference"] + phases["training"]) + n * phases["weight_sync"]


def stopped(out: GenOutcome, stop_s: float) -> GenOutcome:
    """``out`` cut at ``stop_s`` (a short round of tail batching aborts what still runs then): its
    generation, tail and the timeline's segments."""
    end = min(out.generation_s, stop_s)
    segments = [(track, kind, a, min(b, stop_s)) for track, kind, a, b in out.segments if a < stop_s]
    return replace(out, generation_s=end, tail_s=max(0.0, end - out.bulk_s), segments=segments)


def _scale_later_stages(stage_times: dict[str, float], phases: dict[str, float], factor: float) -> None:
    """Inference and training of a step that trains ``factor`` times the batch's tokens (in place)."""
    for name in stage_times:
        if name.split("/")[1] in ("inference", "training"):
            stage_times[name] *= factor
    for stage in ("inference", "training"):
        phases[stage] *= factor

