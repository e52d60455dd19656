"""The RL step's generation on the actor's generation layout: one call of every generation worker (the
fixed batch, or the continuous-batching engine), the engine in chunks with the policy asked between them
(``run.rollout.midstep``: ``run.midstep.EngineLoop``), or the rounds of the levers that change which rows
a step trains (tail batching, partial rollout: ``run.rounds``). Each answers a ``Generated``: the packed
rollout, its rows, the decisions taken inside it and the inference started on finished replicas' rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from nereus.control.backend import GenerationPolicy, RunToEnd
from nereus.cost.engine import EngineCalibration
from nereus.rl.data import Prompt
from nereus.rl.tokenizer import Tokenizer
from nereus.run.draws import PromptDraws
from nereus.run.generated import Generated, decode_metrics
from nereus.run.midstep import EarlyRequest, EngineLoop
from nereus.run.overlap import Call, Calls, EarlyInference, InferenceStage
from nereus.run.partial import PartialRollouts
from nereus.run.rollout import Rollout, pack, repeat_prompts
from nereus.run.rounds import partial_round, tail_round
from nereus.run.setup import SAMPLING
from nereus.run.stage_keys import StageKeys
from nereus.run.step_clock import StepClock
from nereus.run.tail import TailRounds
from nereus.run.tail_decisions import ask_at_start
from nereus.runtime.cluster.calls import GenerateWithLogprobs
from nereus.runtime.cluster.workers import Runtime
from nereus.runtime.engines.answers import DecodeStats, ReplicaRollout
from nereus.runtime.engines.sampling import SamplingParams, derive_seed
from nereus.spec.generation import GenerationEntry
from nereus.spec.job import JobSpec
from nereus.spec.levers import GenerationLevers
from nereus.spec.run_moe import router_replay_on


@dataclass(frozen=True)
class OneCall:
    """Generation in one call of every generation worker: the fixed batch, or the continuous-batching
    engine when ``params.slots`` > 0 (``run.rollout.slots``)."""

    params: SamplingParams


@dataclass(frozen=True)
class WithDecisionPoints:
    """The engine in chunks, the policy asked between them (``run.rollout.midstep``: ``run.midstep``)."""

    params: SamplingParams


@dataclass(frozen=True)
class GenerationCall:
    """A generation in one call: each replica's answer, the run-record entries of the decision taken at its
    start, and the inference started on its finished replicas' rows (None without)."""

    parts: list[ReplicaRollout]
    entries: tuple[GenerationEntry, ...] = ()
    early: EarlyInference | None = None


@dataclass
class Issued:
    """A generation issued without waiting for it (``run.async``'s next step): its call, the rows it
    answers, their prompt ids and the rollout's fixed width (``pad_to_max``, else None)."""

    call: Call
    rows: list[Prompt]
    prompts: list[list[int]]
    fixed: tuple[int, int] | None


class StepGeneration:
    """The generation of ``job``'s steps on runtime ``rt``, on the actor's generation layout ``keys`` names,
    issued through ``calls`` and timed on ``clock`` (``timing_s/gen``); the prompts come from ``draws``.
    Holds what lasts across steps: the engine's measured prices (``run.rollout.midstep``) and the rounds
    of tail batching and partial rollout."""

    def __init__(self, job: JobSpec, rt: Runtime, keys: StageKeys, calls: Calls, clock: StepClock, tok: Tokenizer,
                 draws: PromptDraws) -> None:
        self.job, self.run, self.alg = job, job.run, job.algorithm
        self.rt, self.keys, self.calls, self.clock, self.tok, self.draws = rt, keys, calls, clock, tok, draws
        self.eos = tok.stop_token_ids
        self.engine_prices = EngineCalibration()  # run.rollout.midstep: the engine's prices, measured over the run
        self.tail = TailRounds(job.run.rollout_tail) if job.run.rollout_tail else None  # run.rollout.tail_batching
        partial = job.run.rollout_partial  # run.rollout.partial_rollout
        self.partial = PartialRollouts(partial.over_launch) if partial else None

    def replicas(self) -> int:
        """The generation layout's data-parallel replicas."""
        return self.rt.specs[self.keys["actor", "generation"]].layout.dp

    def prompts(self, step: int) -> list[Prompt]:
        """The step's prompts (``PromptDraws.prompts``)."""
        return self.draws.prompts(step)

    def generation_inputs(self, step: int, rows: list[Prompt], gen_batch: int = 0,
                          ) -> tuple[list[list[int]], SamplingParams, tuple[int, int] | None]:
        """Step ``step``'s generation: the rows' prompt ids, the sampling parameters, and the fixed
        (prompt, response) width of the packed rollout with ``run.rollout.pad_to_max`` (else None).
        ``gen_batch``: the step's generation batch under dynamic sampling (its own sampling seed past 0)."""
        limit = self.run.max_response_length(step, self.job.workload.response.max)
        seed = derive_seed(self.run.seed, SAMPLING, step, *((gen_batch,) if gen_batch else ()))
        params = SamplingParams(max_new_tokens=limit, temperature=self.run.temperature, top_p=self.run.top_p,
                                top_k=self.run.top_k,
                                eos_token_id=self.tok.eos_token_id, pad_token_id=self.tok.pad_token_id,
                                seed=seed, slots=self.run.rollout_slots,
                                stop_token_ids=self.tok.stop_token_ids,
                                speculation=self.run.rollout_engine.live_speculation,
                                record_routes=router_replay_on(self.run.router_replay,
                                                               self.job.models["actor"].moe is not None))
        prompts = [list(p.ids) for p in rows]
        fixed = (max(len(p) for p in prompts), limit) if self.run.rollout_pad_to_max else None
        return prompts, params, fixed

    def generation_mode(self, step: int, params: SamplingParams) -> OneCall | WithDecisionPoints:
        """With ``run.rollout.midstep``: every ``every``-th step generates with decision points (on DP ≥ 2; an
        adaptive run may hold one replica for a while, then the step generates in one call), the steps
        between with the fixed batch. Otherwise one call as ``run.rollout.slots`` says."""
        spec = self.run.rollout_midstep
        if spec is None:
            return OneCall(params)
        if step % spec.every != 0:
            return OneCall(replace(params, slots=0))
        dp = self.replicas()
        return WithDecisionPoints(params) if dp >= 2 else OneCall(params)

    def early_request(self, prompts: list[list[int]], fixed: tuple[int, int] | None,
                      stages: tuple[InferenceStage, ...]) -> EarlyRequest | None:
        """With ``run.overlap`` and ``pad_to_max``: inference starts on each generation replica's rows as it
        ends (``EarlyInference``): ``stages``, the inference stages that may start early."""
        if not self.run.overlap or fixed is None:
            return None
        eos = self.tok.stop_token_ids
        return EarlyRequest(stages, lambda a, b, out: pack(prompts[a:b], [r for r, _ in out], None, eos, fixed).tokens)

    def generate(self, step: int, prompts: list[Prompt], policy: GenerationPolicy | None = None,
                 levers: GenerationLevers | None = None, stages: tuple[InferenceStage, ...] = (),
                 gen_batch: int = 0) -> Generated:
        """Step ``step``'s rollout of ``prompts`` (each repeated ``samples_per_prompt`` times); ``policy`` is
        asked at the decision points of a generation that has them (none: it runs to its end), ``levers``
        are the plan's (``run.tail_decisions``): tail batching's rounds, and in the status the policy decides on.
        ``stages``: the inference stages that may start on finished replicas' rows (``early_request``);
        ``gen_batch``: the step's generation batch under dynamic sampling (``run.dynamic_sampling``)."""
        if self.partial is not None:
            return partial_round(self, self.partial, step, prompts, policy, levers)
        tail = self.tail_rounds(levers)
        if tail is not None:
            return tail_round(self, tail, step, prompts, policy, levers)
        rows = repeat_prompts(prompts, self.alg.samples_per_prompt)
        prompts, params, fixed = self.generation_inputs(step, rows, gen_batch)
        eos, key = self.eos, self.keys["actor", "generation"]
        mode, early = self.generation_mode(step, params), self.early_request(prompts, fixed, stages)
        if isinstance(mode, WithDecisionPoints):
            loop = EngineLoop(self.calls, self.rt, key, mode.params, step, policy or RunToEnd(), self.engine_prices,
                              self.run.rollout_engine.traits)
            with self.clock.timer("gen"):  # early inference on the final call (run.midstep)
                out = loop.run(prompts, early)
            roll = pack(prompts, [r for r, _ in out], [lp for _, lp in out], eos, fixed)
            return Generated(roll, rows, loop.entries(), loop.metrics(), loop.early)
        call = self.one_call(step, prompts, mode.params, policy, levers, early)
        return Generated(self.packed(prompts, call.parts, fixed), rows, call.entries, decode_metrics(call.parts),
                         call.early)

    def one_call(self, step: int, prompts: list[list[int]], params: SamplingParams, policy: GenerationPolicy | None,
                 levers: GenerationLevers | None, early: EarlyRequest | None = None,
                 ) -> GenerationCall:
        """A generation in one call of every generation worker, timed as ``gen``: with the plan's levers the
        policy decides at its start (``run.tail_decisions.ask_at_start``); with ``early`` inference starts on each
        replica's rows as it finishes. The replicas' answers, the decision's run-record entries and the
        inference started early."""
        key = self.keys["actor", "generation"]
        start = None
        if policy is not None and levers is not None:
            start = ask_at_start(policy, step, prompts, params, self.rt.specs[key].layout.dp, levers,
                                 self.run.rollout_engine.traits.drafts)
            params = start.params
        with self.clock.timer("gen"):
            call = self.calls.submit("gen", "generate", key, GenerateWithLogprobs(prompts, params))
            inference = None
            if early is not None:
                inference = EarlyInference(self.calls, call, key, early.stages, len(prompts))
                parts = inference.run(lambda a, b, part: early.pack(a, b, part.rows))
            else:
                parts = self.calls.wait([call])[0]
        entries = start.entries(sum((p.stats for p in parts), DecodeStats())) if start else ()
        return GenerationCall(parts, entries, inference)

    def tail_rounds(self, levers: GenerationLevers | None) -> TailRounds | None:
        """Tail batching's rounds: the job's (``run.rollout.tail_batching``), or those of the plan's lever,
        at its over-launch; after the lever is off, until the prompts it deferred have had their round."""
        lever = levers.tail_batching if levers is not None else None
        if lever is not None:
            self.tail = TailRounds(lever, self.tail.deferred if self.tail else [])
        elif self.tail is not None and self.run.rollout_tail is None:  # the plan turned the lever off
            self.tail = TailRounds(self.tail.spec, self.tail.deferred, draining=True) if self.tail.deferred else None
        return self.tail

    def packed(self, prompts: list[list[int]], parts: list[ReplicaRollout], fixed: tuple[int, int] | None) -> Rollout:
        """The replicas' answers for ``prompts`` packed into the step's rollout, with their routes where every
        replica recorded them (router replay)."""
        out = [row for part in parts for row in part.rows]
        routes = None if any(p.routes is None for p in parts) else [r for p in parts for r in p.routes]
        return pack(prompts, [r for r, _ in out], [lp for _, lp in out], self.eos, fixed, routes)

    def issue(self, step: int) -> Issued:
        """Issue step ``step``'s generation in one call without waiting for it, with the sampling parameters
        ``generate`` uses (``run.async`` generates the next step while this one trains)."""
        rows = repeat_prompts(self.prompts(step), self.alg.samples_per_prompt)
        prompts, params, fixed = self.generation_inputs(step, rows)
        call = self.calls.submit("gen", "generate", self.keys["actor", "generation"],
                                 GenerateWithLogprobs(prompts, params))
        return Issued(call, rows, prompts, fixed)

    def greedy(self, step: int, prompts: list[Prompt]) -> Rollout:
        """ReMax's baseline responses (Li et al. 2023, arXiv:2310.10505): one greedy response to each of
        ``prompts`` at the step's length limit, a generation pass of its own on the actor's generation layout,
        timed as ``gen_max`` (verl's ``timing_s/gen_max``); ``prompts`` split evenly over the replicas."""
        ids, params, _ = self.generation_inputs(step, prompts)
        with self.clock.timer("gen_max"):
            call = self.calls.submit("gen_max", "generate", self.keys["actor", "generation"],
                                     GenerateWithLogprobs(ids, replace(params, temperature=0.0)))
            out = [row for part in self.calls.wait([call])[0] for row in part.rows]
        return pack(ids, [r for r, _ in out], [lp for _, lp in out], self.eos)
