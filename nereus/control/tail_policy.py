"""Decisions about the levers that shorten the tail: which a step's generation uses, priced by the cost model.

A ``LeverRule`` picks a plan's ``spec.levers.GenerationLevers`` for the next steps (``PhasedPolicy`` calls
it next to its tail-layout rule and keeps whichever predicts the larger gain); inside the step the policy
turns them into decisions (``set_speculation`` at the stage's start: the engine then switches each replica
by its live batch). ``run.policy_lag`` bounds what a rule may pick: lag 0 allows speculative decoding
(lossless) and tail batching; lag 1 also partial rollout and asynchrony.

- ``NereusLevers``: speculative decoding priced at sequence granularity (``cost.tail.spec_run``) on the
  forecast's lengths under the calibrated factors, for the model-free draft kind of highest acceptance
  (their drafting costs the same), draft length 1–8 and live-batch threshold (powers of two up to the
  engine's slots), at the acceptance it has measured (each kind's published prior until it has
  verifications of its own: ``cost.tail.speculative.Acceptance``); admitted when the predicted gain
  exceeds ``min_gain`` of the step. Speculation's loss at large batch is
  in the price (verification at (k + 1)·b rows turns compute-bound), so the threshold is the cost model's.
  The policy never reads the trace's acceptance: it sees the verifications and accepted tokens the
  engine reports (vLLM's ``num_drafts`` and ``num_accepted_tokens``).
  It prices tail batching (``cost.tail.tail_batching``: the over-launch factor that pays most, at a
  prior sibling correlation) as the alternative to speculation.
  With ``run.policy_lag`` 1 it also prices partial rollout on the forecast's steady-state round at
  sequence granularity (``cost.tail.partial_rollout.steady_round``: budgets from the smallest whose
  tokens are at most one step old up to the longest response), alone and with the speculation, and keeps
  the fastest.
- ``FixedSpeculation``: one fixed configuration, as an operator sets it once (the ``spec-like`` baseline);
  ``FixedPartialRollout``: a fixed per-step budget (``april-like``); ``FixedTailBatching``: a fixed
  over-launch factor (``rollpacker-like``); ``FixedAsync``: one-step-off
  asynchrony on a fixed pool split (``verl-async-like``).
"""

from __future__ import annotations

import statistics
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace

import numpy as np

from nereus.control.backend import StepMetrics
from nereus.cost.batching import Factors
from nereus.cost.generation import BulkRun, GenModel, forecast_lengths, no_move, run_bulk
from nereus.cost.hardware import Hardware
from nereus.cost.plan_cost import estimate_plan
from nereus.cost.stages import generation_replica
from nereus.cost.tail.lengths import GroupLengths, MeasuredLengths, RolloutPool, measured_groups
from nereus.cost.tail.partial_rollout import budget_for_lag, steady_round
from nereus.cost.tail.spec_run import MODEL_FREE, switch_times, with_speculation
from nereus.cost.tail.speculative import Acceptance, DraftKind, prior
from nereus.cost.tail.tail_batching import Lengths, TailBatchingEstimate, best_over_launch, tail_batching
from nereus.spec.generation import SetSpeculation
from nereus.spec.job import JobSpec
from nereus.spec.layout import Plan
from nereus.spec.levers import AsyncSplit, GenerationLevers, PartialRollout, Speculation, TailBatching

DRAFT_LENGTHS = tuple(range(1, 9))
OVER_LAUNCHES = (1.0, 1.25, 1.5, 2.0, 3.0)  # tail batching's candidates (cost.tail.tail_batching's)
# The sibling correlation of log lengths the controller prices tail batching at until a backend measures it
# (the runtime does, on each step's groups: StepMetrics.sibling_correlation; the simulator's policy cannot
# read its trace's): Seer (arXiv 2511.14617) reports responses to one prompt "strongly similar" in length
# without a coefficient; 0.5 is ours.
SIBLINGS_PRIOR = 0.5
SIBLINGS_WINDOW = 10  # steps of measured sibling correlation the rule prices at (their median)
# Measured groups the rule prices tail batching on once it has them (the last SIBLINGS_WINDOW plain steps'):
# a short round's stop is the 1/f quantile of group completion lengths, over-launch 3 its lowest third,
# which 32 groups resolve to a few groups (two steps of the runtime's 16-prompt GRPO job).
MEASURED_GROUPS_MIN = 32


# Terms of a stage's cost that do not grow with the rollout's padded width (``cost.stages.TERMS``): weights
# read per micro-batch, the optimizer step, the gradient all-reduce (or FSDP's gathers), per-micro-batch
# dispatch, weight syncs. The rest (compute, TP and PP activation traffic) scales with tokens.
WIDTH_FREE_TERMS = ("memory", "optimizer", "dp_comm", "overhead", "sync")


@dataclass(frozen=True)
class PaddedRest:
    """Inference and training seconds of a step on a backend that pads each step's rollouts to its longest
    response (``RuntimeCapability.padded_rollouts``: the CPU runtime packs [prompt, response, pad]): the
    part that grows with width is rows × (prompt + longest), so a round of shorter responses shortens it;
    ``fixed_s`` of them does not (``WIDTH_FREE_TERMS``). ``padded_generation``: the round's generation
    pads too — the runtime's fixed batch (``run.rollout.slots: 0``) keeps every row in its forward until
    the round's longest response ends, so a round costs its rows × its longest, whatever the others'
    lengths."""

    seconds: float
    prompt: float
    fixed_s: float = 0.0
    padded_generation: bool = False

    def at(self, longest: float, plain_longest: float) -> float:
        """The seconds of a round whose longest response is ``longest`` (``seconds`` priced at
        ``plain_longest``)."""
        width = (self.prompt + longest) / (self.prompt + plain_longest)
        return self.fixed_s + (self.seconds - self.fixed_s) * width


@dataclass(frozen=True)
class LeverChoice:
    """A rule's levers for the next steps and the generation seconds it predicts they save per step."""

    levers: GenerationLevers
    gain_s: float


class LeverRule(ABC):
    name = "none"

    @abstractmethod
    def choose(self, model: GenModel, bulk: BulkRun, f: Factors, policy_lag: int,
               rest: PaddedRest | None = None) -> LeverChoice | None:
        """The levers for the step whose forecast is ``bulk`` (None: none pays); ``rest``: the step's other
        stages when the backend pads rollouts (their time then follows the round's longest response)."""

    def observe(self, m: StepMetrics) -> None:  # noqa: B027 - a rule that learns nothing keeps this default
        """Default: learn nothing from measurements."""


@dataclass
class NereusLevers(LeverRule):
    min_gain: float = 0.01  # of the predicted generation time
    acceptance: dict[str, Acceptance] = field(default_factory=dict)
    name: str = "nereus"
    siblings_measured: list[float] = field(default_factory=list)  # per step, where the backend measures it
    sigma_measured: list[float] = field(default_factory=list)  # the spread of log lengths, likewise
    lengths_measured: list[tuple[float, ...]] = field(default_factory=list)  # per step, its responses' lengths
    # the log-normal length model last priced on, kept while its inputs stay, with the quantiles it answered
    last_lengths: GroupLengths | None = field(default=None, repr=False, compare=False)

    def alpha(self, draft: str) -> float:
        return self.acceptance.get(draft, prior(DraftKind(draft))).alpha

    @property
    def siblings(self) -> float:
        """The sibling correlation tail batching is priced at: the median of the last steps' measurements,
        the prior until there is one."""
        recent = self.siblings_measured[-SIBLINGS_WINDOW:]
        return statistics.median(recent) if recent else SIBLINGS_PRIOR

    def lengths(self, job: JobSpec) -> Lengths:
        """The length model tail batching is priced on: where the backend reports its responses' lengths,
        the groups of the last plain steps (``MEASURED_GROUPS_MIN`` at least); else the job's (forecast)
        response lengths as a log-normal, their spread and the sibling correlation as measured where the
        backend measures them (the median of the last steps, the job's and the prior until then)."""
        size = job.algorithm.samples_per_prompt
        groups = tuple(g for step in self.lengths_measured for g in measured_groups(step, size))  # the window
        if len(groups) >= MEASURED_GROUPS_MIN:
            return MeasuredLengths(groups, job.workload.response.max)
        resp, recent = job.workload.response, self.sigma_measured[-SIBLINGS_WINDOW:]
        if recent:
            resp = replace(resp, sigma=statistics.median(recent))
        built = GroupLengths.of(resp, self.siblings, job.algorithm.samples_per_prompt)
        if built != self.last_lengths:
            self.last_lengths = built
        return self.last_lengths

    def observe(self, m: StepMetrics) -> None:
        """Calibrate each draft kind's acceptance on the verifications the engine measured, and the length
        spread and sibling correlation on the step's responses where the backend measures them: on steps
        without tail batching only (a short round keeps the groups that end first, a long round the
        others: neither is the step's draw)."""
        if m.levers is None or m.levers.tail_batching is None:
            if m.sibling_correlation is not None:
                self.siblings_measured.append(m.sibling_correlation)
            if m.length_sigma is not None and m.length_sigma > 0:
                self.sigma_measured.append(m.length_sigma)
            if m.response_lengths:  # only the window is priced on: a long run keeps no more
                self.lengths_measured = [*self.lengths_measured[1 - SIBLINGS_WINDOW:], m.response_lengths]
        for e in m.generation:
            d = e.decision
            if isinstance(d, SetSpeculation) and d.speculation is not None and e.outcome.applied:
                kind = d.speculation.draft
                current = self.acceptance.get(kind, prior(DraftKind(kind)))
                self.acceptance[kind] = current.observe(e.outcome.figures.get("accepted_tokens", 0.0),
                                                        e.outcome.figures.get("verifications", 0.0),
                                                        d.speculation.draft_tokens)

    def choose(self, model: GenModel, bulk: BulkRun, f: Factors, policy_lag: int,
               rest: PaddedRest | None = None) -> LeverChoice | None:
        base = no_move(model, bulk).generation_s
        spec_s, spec = self._speculation(model, bulk, f)
        spec = spec if base - spec_s > self.min_gain * base else None
        others = rest.seconds if rest is not None else 0.0  # the same for every lever but tail batching
        options = [(spec_s + others, GenerationLevers(speculation=spec))] if spec is not None else []
        lengths = self.lengths(model.job)  # one length model for tail batching alone and with speculation
        batching = self._tail_batching(model, lengths, base, rest)
        if batching is not None:
            options.append((batching[1], GenerationLevers(tail_batching=batching[0])))
            if spec is not None:  # both: each round's generation speculated
                both = self._with_speculation(model, lengths, batching, spec, f, base, rest)
                options.append((both, GenerationLevers(speculation=spec, tail_batching=batching[0])))
        if policy_lag >= 1:
            options += [(t + others, lv) for t, lv in self._partial(model, bulk, f, policy_lag, spec)]
        if not options:
            return None
        t, chosen = min(options, key=lambda x: x[0])
        base += others  # with ``rest``: whole steps compared, else generation alone
        predicted = {"gain_s": base - t, "generation_s" if rest is None else "step_s": t, "base_s": base}
        if rest is not None:  # the runner-ups, as the planner explains its choice
            predicted.update({f"{lv.kinds}_s": s for s, lv in sorted(options, key=lambda x: x[0], reverse=True)})
        if chosen.speculation is not None:
            predicted["alpha"] = self.alpha(chosen.speculation.draft)
        levers = GenerationLevers(chosen.speculation, chosen.tail_batching, chosen.partial_rollout, None, self.name,
                                  predicted)
        return LeverChoice(levers, base - t)

    def _speculation(self, model: GenModel, bulk: BulkRun, f: Factors) -> tuple[float, Speculation]:
        """The fastest speculation on the forecast and its generation seconds. The model-free kinds cost the
        same to draft (a lookup per sequence), so the one with the highest acceptance wins at every k and
        threshold: coarse, its every draft length on at every live batch; fine, the best one's thresholds.
        Thresholds that switch every replica at the same moments price the same (a replica holding 8
        sequences switches at its last start for every threshold from 8 up): each is priced once."""
        seen: dict[tuple[int, bytes], float] = {}

        def priced(s: Speculation) -> tuple[float, Speculation]:
            key = (s.draft_tokens, switch_times(bulk, s.live_at_most).tobytes())
            if key not in seen:
                alpha = self.alpha(s.draft)
                seen[key] = with_speculation(model, bulk, s.draft_tokens, s.live_at_most, alpha, f).outcome.generation_s
            return seen[key], s

        draft = max(MODEL_FREE, key=self.alpha)
        best = min((priced(Speculation(draft, k, model.slots)) for k in DRAFT_LENGTHS), key=lambda x: x[0])
        spec = best[1]
        for live in powers_of_two(model.slots):
            best = min(best, priced(Speculation(spec.draft, spec.draft_tokens, live)), key=lambda x: x[0])
        return best

    def _with_speculation(self, model: GenModel, lengths: Lengths,
                          batching: tuple[TailBatching, float, TailBatchingEstimate], spec: Speculation, f: Factors,
                          base: float, rest: PaddedRest | None) -> float:
        """Tail batching's seconds per step (``batching``) with ``spec`` in its rounds: each round's
        generation times what speculation saves on its lengths (the short round's clipped at its stop, so
        that a live-batch threshold below the sequences still running there switches nothing on; the long
        round's the deferred prompts')."""
        _, t, est = batching
        short = np.minimum(spread(lengths.response_quantiles(), round(est.short.sequences)), est.stop_length)
        long = spread(lengths.deferred_quantiles(est.stop_length), round(est.long.sequences))
        long[-1] = max(long[-1], est.long.longest)
        ratios = []
        for lens in (short, long):
            rnd = run_bulk(model, np.maximum(1.0, lens), f)
            plain = no_move(model, rnd).generation_s
            fast = with_speculation(model, rnd, spec.draft_tokens, spec.live_at_most, self.alpha(spec.draft), f)
            ratios.append(fast.outcome.generation_s / plain if plain > 0 else 1.0)
        scale = base / est.plain.seconds  # the pool's round seconds in the generation model's units
        gen = [r.seconds * scale * q for r, q in zip((est.short, est.long), ratios, strict=True)]
        others = [rest.at(r.longest, est.plain.longest) if rest is not None else 0.0 for r in (est.short, est.long)]
        n = est.long_rounds_per_short
        return (gen[0] + others[0] + n * (gen[1] + others[1])) / (1 + n)

    def _pool(self, model: GenModel, rest: PaddedRest | None = None) -> RolloutPool:
        job = model.job
        replica = generation_replica(model.hw, model.arch, model.placement.layout.tp, job.options.weight_bytes)
        padded = rest is not None and rest.padded_generation
        return RolloutPool(replica, model.placement.layout.dp, model.slots, float(job.workload.prompt_length),
                           padded)

    def _tail_batching(self, model: GenModel, lengths: Lengths, base: float,
                       rest: PaddedRest | None) -> tuple[TailBatching, float, TailBatchingEstimate] | None:
        """The over-launch factor that pays most (``cost.tail.tail_batching``) at the prior sibling
        correlation, the seconds it predicts per step (of generation alone: ``base`` scaled by its speedup;
        or with ``rest`` of the whole step, each round's other stages at its longest response) and its
        estimate. None when none pays ``min_gain``."""
        job = model.job
        pool, groups = self._pool(model, rest), job.workload.prompts_per_step
        if rest is None:
            est = best_over_launch(pool, lengths, groups)
            if est.over_launch <= 1.0 or est.speedup <= 1 + self.min_gain:
                return None
            return TailBatching(est.over_launch), base / est.speedup, est
        est = min((tail_batching(pool, lengths, groups, f) for f in OVER_LAUNCHES),
                  key=lambda e: cycle_s(e, base, rest))
        t, plain = cycle_s(est, base, rest), base + rest.seconds
        if est.over_launch <= 1.0 or plain - t <= self.min_gain * plain:
            return None
        return TailBatching(est.over_launch), t, est

    def _partial(self, model: GenModel, bulk: BulkRun, f: Factors, policy_lag: int,
                 spec: Speculation | None) -> list[tuple[float, GenerationLevers]]:
        """Partial rollout at budgets from the smallest whose tokens are at most ``policy_lag`` steps old
        up to the longest response, priced on the forecast's steady-state round at sequence granularity
        (``cost.tail.partial_rollout.steady_round``: the resumed responses re-prefilled), alone and with
        ``spec``."""
        top = model.job.workload.response.max
        low = budget_for_lag(top, policy_lag)
        prompt = float(model.job.workload.prompt_length)
        options = []
        for budget in sorted({low + (top - low) * i // 3 for i in range(3)}):
            tokens, context = steady_round(bulk.lengths, prompt, budget)
            rnd = run_bulk(model, tokens, f, context)
            cut = PartialRollout(budget)
            options.append((no_move(model, rnd).generation_s, GenerationLevers(partial_rollout=cut)))
            if spec is not None:
                s = with_speculation(model, rnd, spec.draft_tokens, spec.live_at_most, self.alpha(spec.draft), f)
                options.append((s.outcome.generation_s, GenerationLevers(speculation=spec, partial_rollout=cut)))
        return options


@dataclass
class FixedSpeculation(LeverRule):
    """Speculation of one fixed configuration on every step, below a fixed live-batch threshold."""

    speculation: Speculation
    name: str = "spec-like"

    def choose(self, model: GenModel, bulk: BulkRun, f: Factors, policy_lag: int,
               rest: PaddedRest | None = None) -> LeverChoice | None:
        base = no_move(model, bulk).generation_s
        s = self.speculation
        t = with_speculation(model, bulk, s.draft_tokens, s.live_at_most, prior(DraftKind(s.draft)).alpha,
                             f).outcome.generation_s
        predicted = {"gain_s": base - t, "generation_s": t, "base_s": base}
        return LeverChoice(GenerationLevers(speculation=s, policy=self.name, predicted=predicted), base - t)


@dataclass
class FixedPartialRollout(LeverRule):
    """Partial rollout every step at the smallest budget whose tokens are at most ``lag`` steps old
    (``budget_for_lag`` of the job's longest response), whatever it costs."""

    lag: int = 1
    name: str = "april-like"

    def choose(self, model: GenModel, bulk: BulkRun, f: Factors, policy_lag: int,
               rest: PaddedRest | None = None) -> LeverChoice | None:
        budget = PartialRollout(budget_for_lag(model.job.workload.response.max, self.lag))
        return LeverChoice(GenerationLevers(partial_rollout=budget, policy=self.name), 0.0)


@dataclass
class FixedTailBatching(LeverRule):
    """Tail batching at a fixed over-launch factor, every step."""

    tail_batching: TailBatching
    name: str = "rollpacker-like"

    def choose(self, model: GenModel, bulk: BulkRun, f: Factors, policy_lag: int,
               rest: PaddedRest | None = None) -> LeverChoice | None:
        return LeverChoice(GenerationLevers(tail_batching=self.tail_batching, policy=self.name), 0.0)


@dataclass
class FixedAsync(LeverRule):
    """One-step-off asynchrony on the plan's own pools: generation of step k + 1 on the rollout's GPUs
    while the others train step k (the plan must place them apart: the backend checks)."""

    staleness: int = 1
    name: str = "verl-async-like"

    def choose(self, model: GenModel, bulk: BulkRun, f: Factors, policy_lag: int,
               rest: PaddedRest | None = None) -> LeverChoice | None:
        split = AsyncSplit(len(model.placement.gpus), self.staleness)
        return LeverChoice(GenerationLevers(async_split=split, policy=self.name), 0.0)


def generation_forecast(job: JobSpec, plan: Plan, factors: dict[str, float],
                        transfer: float = 1.0) -> tuple[GenModel, BulkRun, Factors, float]:
    """What the rules price a plan's generation on: its model, the bulk run of the forecast's lengths,
    the calibrated factors, and the inference phase's seconds."""
    hw = Hardware(job.cluster)
    est = estimate_plan(hw, job, plan, factors or None)
    model = GenModel.of(hw, job, plan, est)
    f = Factors.of(factors, transfer)
    lengths = forecast_lengths(job.workload.response, job.sequences_per_step())
    return model, run_bulk(model, lengths, f), f, est.phase_times["inference"]


def cycle_s(est: TailBatchingEstimate, base: float, rest: PaddedRest) -> float:
    """Seconds per step over tail batching's cycle (one short round, f − 1 long ones): each round's
    generation (the estimate's pool seconds in the units of ``base``, the plain round's generation) plus its
    other stages at its longest response."""
    scale = base / est.plain.seconds
    s = [r.seconds * scale + rest.at(r.longest, est.plain.longest) for r in (est.short, est.long)]
    return (s[0] + est.long_rounds_per_short * s[1]) / (1 + est.long_rounds_per_short)


def spread(quantiles: tuple[float, ...], n: int) -> np.ndarray:
    """``n`` lengths standing for equally weighted ``quantiles`` (interpolated between them)."""
    q = np.asarray(quantiles, float)
    return np.interp(np.linspace(0, len(q) - 1, max(1, n)), np.arange(len(q)), q)


def padded_rest(job: JobSpec, plan: Plan, factors: dict[str, float]) -> PaddedRest:
    """The plan's predicted inference and training seconds at the forecast workload, for a backend that
    pads rollouts (``PaddedRest``): their width-free share from the stages' calibrated cost terms, and
    whether generation runs in the fixed batch (no ``run.rollout.slots``)."""
    est = estimate_plan(Hardware(job.cluster), job, plan, factors or None)
    seconds = est.phase_times["inference"] + est.phase_times["training"]
    costs = [est.costs[str(p.model_stage)] for p in plan.placements if p.model_stage.stage in ("inference", "training")]
    total = sum(c.time(factors) for c in costs)
    fixed = sum(replace(c, terms={k: v for k, v in c.terms.items() if k in WIDTH_FREE_TERMS}).time(factors)
                for c in costs)
    share = fixed / total if total > 0 else 0.0
    fixed_batch = job.run is not None and job.run.rollout_engine.traits.slots(job.run.rollout_slots) == 0
    return PaddedRest(seconds, float(job.workload.prompt_length), seconds * share, fixed_batch)


def powers_of_two(limit: int) -> list[int]:
    """1, 2, 4, ... up to ``limit``: the live batches and replica counts the rules try."""
    out, k = [], 1
    while k <= limit:
        out.append(k)
        k *= 2
    return out


def speculation_decision(levers: GenerationLevers | None) -> SetSpeculation | None:
    """The decision at the stage's start that turns a plan's speculation on (None: the plan has none)."""
    if levers is None or levers.speculation is None:
        return None
    s = levers.speculation
    return SetSpeculation(speculation=s, gain_s=float(levers.predicted.get("gain_s", 0.0)),
                          reason=f"{levers.policy}: {s.draft} drafts, k={s.draft_tokens}, on at <= {s.live_at_most} "
                                 "live sequences per replica")
