"""The runtime's engine loop with decision points (``run.rollout.midstep``): one step's generation on the
continuous-batching engine, run in chunks, the policy asked between them.

Each worker keeps its replica's engine across calls (``runtime.engines.native.session``): ``gen_open`` queues
the replica's rows, ``gen_run`` runs a chunk of iterations and answers the replica's ``ReplicaStatus``,
``gen_migrate`` executes a ``MigrationPlan`` on every worker of the world (the commit vote is world-wide),
``gen_close`` runs the replica to the end and answers its sequences. ``EngineLoop`` drives them:

1. after ``gen_open`` it builds a ``GenerationStatus`` (every sequence queued) and asks
   ``policy.during_generation``; while the answer names a next decision point (``NextLook.iterations``),
   it runs every replica that many iterations (one round trip, which also holds the replicas in
   lockstep), then asks again with the replicas' statuses — every unfinished sequence's forecast final
   length (``cost.engine.EngineCalibration.forecasts``) and what was measured so far (rows and seconds
   per replica, the driver's overhead per call, the calibrated fixed cost of a move) filled in;
2. a ``MoveSequences`` answer becomes a ``MigrationPlan`` (``elastic.kvplan.plan_migration``, source and
   destination the same placement) executed by ``Worker.gen_migrate``; a move that fails before its commit
   point moves nothing, and the step goes on with every sequence where it was;
3. once no further point is named, the final call runs every replica to the end (``gen_close``); with
   ``run.overlap`` and ``pad_to_max`` inference starts on a finished replica's rows during it
   (``EarlyInference``) when no move committed in the step, so that each replica answers exactly its own
   block of rows.

**Measured gain** of a committed move, once generation has ended: the no-move counterfactual from the
decision point minus the measured wall time from the decision point to the end of generation. The
counterfactual is the plain engine's: no move and no further look, every replica run to the end in one
call (``cost.engine.plain_finish_s``, with the sequences' actual final lengths, each replica's measured
seconds per row in this step, plus one call's measured driver overhead). The looks, lockstep waits and
decisions after the decision point are on the measured side, so a move that only pays for the looks reads
as no gain; a later move of the same step counts in an earlier one's figure. ``midstep/step_gain_s`` is
the same comparison for the whole generation (from the step's initial queues, against the wall time from
``gen_open`` to the final answer); ``midstep/poll_s`` the generation's wall time less its slowest
replica's busy time. They are figures of the run, never asserted in tests.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from nereus.control.backend import GenerationPolicy
from nereus.cost.engine import EngineCalibration, plain_finish_s, row_seconds
from nereus.elastic.kvplan import GenPlacement, KVShape, MigrationPlan, SeqMove, plan_migration
from nereus.run.overlap import Call, Calls, EarlyInference, InferenceStage
from nereus.run.tail_decisions import STAGE, engine_speculation, queued
from nereus.runtime.cluster.calls import GenClose, GenMigrate, GenOpen, GenRun, GenSpeculate, KeyCall
from nereus.runtime.cluster.workers import Runtime
from nereus.runtime.engines.answers import ClosedReplica, MigrationOutcome
from nereus.runtime.engines.sampling import SamplingParams
from nereus.runtime.model.dtypes import torch_dtype
from nereus.runtime.transitions.live import KeySpec
from nereus.spec.engines import DEFAULT_ENGINE, ENGINE_TRAITS, EngineTraits
from nereus.spec.generation import (
    GenerationDecision,
    GenerationEntry,
    GenerationStatus,
    Measured,
    MoveSequences,
    Outcome,
    ReplicaStatus,
    SetSpeculation,
)

METRICS = ("midstep/decisions", "midstep/moves", "midstep/moved_sequences", "midstep/move_s",
           "midstep/predicted_gain_s", "midstep/predicted_cost_s", "midstep/measured_gain_s", "midstep/chunks",
           "midstep/row_ms", "midstep/step_gain_s", "midstep/poll_s")
Response = tuple[list[int], list[float]]  # a sequence's new tokens and their sampling log-probs


@dataclass(frozen=True)
class EarlyRequest:
    """Inference to start on a generation replica's block of rows as soon as that replica finishes
    (``run.overlap`` with ``run.rollout.pad_to_max``): the stages, and the packer of a block (start, stop,
    its responses in row order) to the step's fixed width."""

    stages: tuple[InferenceStage, ...]
    pack: Callable[[int, int, list[Response]], torch.Tensor]


@dataclass
class Recorded:
    """A recorded decision of this generation and what is known of its outcome so far."""

    status: GenerationStatus
    decision: GenerationDecision
    overhead_s: float
    outcome: Outcome
    at: float = 0.0  # when the move began (measured gain), for a committed move
    seen: tuple[ReplicaStatus, ...] = ()  # the replicas it was decided on


def kv_shape(spec: KeySpec) -> KVShape:
    """The KV-cache geometry of a runtime key."""
    a = spec.cfg.arch
    return KVShape(a.layers, a.kv_heads, a.head_dim, torch_dtype(spec.dtype).itemsize)


def migrate_on_world(calls: Calls, rt: Runtime, key: str, plan: MigrationPlan) -> list[MigrationOutcome]:
    """``Worker.gen_migrate`` on every worker of the world (the commit vote is world-wide), accounted as
    generation time of each worker; every worker's answer, by rank. Each worker's engine of the key moves
    its rows its own way (``Engine.migrate``)."""
    call = Call("gen", "generate", rt.submit_all(GenMigrate(key, plan)), time.perf_counter())
    calls.calls.append(call)
    answers = rt.answers(list(call.refs.values()))
    now = time.perf_counter()
    call.done.update({rank: now for rank in call.refs})
    return answers


class EngineLoop:
    """The chunks, decision points, moves and measurements of one step's generation on key ``key``."""

    def __init__(self, calls: Calls, rt: Runtime, key: str, params: SamplingParams, step: int,
                 policy: GenerationPolicy, prices: EngineCalibration,
                 traits: EngineTraits = ENGINE_TRAITS[DEFAULT_ENGINE]) -> None:
        self.calls, self.rt, self.key, self.params, self.step = calls, rt, key, params, step
        self.traits = traits  # the rollout engine's: which speculation it switches (its moves are its own)
        self.policy, self.prices = policy, prices
        self.spec = rt.specs[key]
        self.shape = kv_shape(self.spec)
        dp = self.spec.layout.dp
        self.rows, self.busy = [0] * dp, [0.0] * dp
        self.chunks: list[tuple[float, float]] = []  # (driver wall s, slowest replica's busy s) per chunk
        self.iteration = 0
        self.recorded: list[Recorded] = []
        self.seen: set[int] = set()  # sequences whose final length the calibration holds already
        self.early: EarlyInference | None = None  # the final call's early inference, when it ran
        self.t_open = 0.0
        self.step_gain_s = self.poll_s = 0.0  # set by ``measure``

    def _op(self, request: KeyCall) -> list:
        """``request`` on every worker of the key, waited for: the replicas' answers in DP order."""
        return self.calls.wait([self.calls.submit("gen", "generate", self.key, request)])[0]

    def run(self, prompts: list[list[int]], early: EarlyRequest | None = None) -> list[Response]:
        """``generate_with_logprobs``'s answer for ``prompts``, with the policy's decisions on the way."""
        self.t_open = time.perf_counter()
        self._op(GenOpen(prompts, self.params))
        start = reps = queued(prompts, self.spec.layout.dp)  # gen_open queues each replica's block
        d = self.ask("start", reps)
        while not d.look.none:
            if not d.look.iterations:
                raise ValueError(f"{type(self.policy).__name__}: the runtime's engine loop looks after a number of "
                                 f"iterations (NextLook.iterations), not at {d.look}")
            reps = self.chunk(d.look.iterations)
            if all(rep.unfinished == 0 for rep in reps):
                break
            d = self.ask("look", reps)
        done: dict[int, Response] = {}
        for part in self.finish(len(prompts), early):
            self.account(part.replica, part.rows, part.busy_s)
            done.update(part.done)
        t_end = time.perf_counter()
        self.prices.observe_lengths(len(done[i][0]) for i in sorted(set(done) - self.seen))
        out = [done[i] for i in range(len(prompts))]
        self.measure(out, start, t_end - self.t_open, t_end)
        return out

    def status(self, point: str, reps: tuple[ReplicaStatus, ...]) -> GenerationStatus:
        """The status at a decision point: each record's forecast and the measurements so far filled in."""
        limit = self.params.max_new_tokens
        guess = self.prices.forecasts((s.generated for r in reps for s in r.active + r.queued), limit)
        reps = tuple(replace(r, active=tuple(replace(s, forecast=guess[s.generated]) for s in r.active),
                             queued=tuple(replace(s, forecast=guess[s.generated]) for s in r.queued)) for r in reps)
        overhead = statistics.fmean(max(0.0, w - b) for w, b in self.chunks) if self.chunks else None
        measured = Measured(tuple(self.rows), tuple(self.busy), overhead, self.prices.move_fixed_s(),
                            time.perf_counter() - self.t_open)
        return GenerationStatus(self.step, STAGE, point, self.iteration, self.params.slots, limit, reps, measured,
                                self.shape.token_bytes)

    def ask(self, point: str, reps: tuple[ReplicaStatus, ...]) -> GenerationDecision:
        """The policy's decision at this point, carried out (a move) and recorded when it says so."""
        status = self.status(point, reps)
        t0 = time.perf_counter()
        d = self.policy.during_generation(status)
        overhead = time.perf_counter() - t0
        if isinstance(d, MoveSequences):
            self.move(status, d, overhead)
        elif isinstance(d, SetSpeculation):
            self.speculate(status, d, overhead)
        elif d.recorded:
            reason = "declined" if not d.acts else f"the runtime does not carry out {d.kind} yet"
            self.recorded.append(Recorded(status, d, overhead, Outcome(False, reason)))
        return d

    def account(self, d: int, rows: int, busy_s: float) -> None:
        """Replica ``d``'s rows and busy seconds of one call (``gen_run``/``gen_close``)."""
        self.rows[d] += rows
        self.busy[d] += busy_s

    def chunk(self, iterations: int) -> tuple[ReplicaStatus, ...]:
        t0 = time.perf_counter()
        states: list[ReplicaStatus] = self._op(GenRun(iterations))
        wall = time.perf_counter() - t0
        for st in states:
            self.account(st.replica, st.rows, st.busy_s)
            self.prices.observe_lengths(n for _, n in st.finished)
            self.seen.update(i for i, _ in st.finished)
        self.chunks.append((wall, max(st.busy_s for st in states)))
        self.iteration += max(st.iterations for st in states)
        return tuple(states)

    def move(self, status: GenerationStatus, d: MoveSequences, overhead: float) -> None:
        """Execute ``d`` on every worker; nothing moves unless every worker passes the commit point."""
        t0 = time.perf_counter()
        where = GenPlacement(self.spec.layout, tuple(self.spec.ranks))
        moves = [SeqMove(m.seq.id, m.seq.prompt, m.seq.generated, m.seq.cached, m.seq.rng_bytes, m.seq.replica,
                         m.dst, m.refill) for m in d.moves]
        plan = plan_migration(self.spec.model, self.shape, where, where, moves)
        answers = migrate_on_world(self.calls, self.rt, self.key, plan)
        move_s = time.perf_counter() - t0
        failed = [a.error for a in answers if not a.ok]
        if failed:  # nothing moved: every sequence is still where it was (kv_migrate's commit point)
            outcome = Outcome(False, f"aborted, nothing moved: {failed[0][:300]}", move_s)
        else:
            outcome = Outcome(True, "", move_s)
            self.prices.observe_move(d.bytes, move_s)
        self.recorded.append(Recorded(status, d, overhead, outcome, t0, status.replicas))

    def speculate(self, status: GenerationStatus, d: SetSpeculation, overhead: float) -> None:
        """Switch every replica's speculation; the drafts proposed and accepted so far go in the outcome.
        The native engine drafts from n-grams of the sequence and its siblings (``ngram`` and ``suffix``
        kinds); a draft model or head, or an engine whose speculation is fixed when it starts, is recorded
        as not carried out."""
        try:
            if self.traits.speculation != "live":
                raise ValueError(f"the {self.traits.label} engine's speculation is fixed when it starts")
            spec = engine_speculation(d.speculation, self.traits.drafts)
        except ValueError as err:
            self.recorded.append(Recorded(status, d, overhead, Outcome(False, str(err))))
            return
        t0 = time.perf_counter()
        counts = self._op(GenSpeculate(spec))
        figures = {"draft_tokens": float(sum(a for a, _ in counts)),
                   "accepted_tokens": float(sum(b for _, b in counts))}
        self.recorded.append(Recorded(status, d, overhead, Outcome(True, "", time.perf_counter() - t0, None, figures)))

    def committed(self) -> list[Recorded]:
        """The moves that committed (a speculation switch moves no row)."""
        return [r for r in self.recorded if r.outcome.applied and isinstance(r.decision, MoveSequences)]

    def finish(self, n: int, early: EarlyRequest | None) -> list[ClosedReplica]:
        """The final call: every replica runs to the end and answers its sequences (``gen_close``). Early
        inference takes a finished replica's block only when no move committed in this step, so that the
        replica's answer holds exactly its block of rows, the very rows the plain engine's call answers."""
        call = self.calls.submit("gen", "generate", self.key, GenClose())
        if early is None or self.committed():
            return self.calls.wait([call])[0]
        self.early = EarlyInference(self.calls, call, self.key, early.stages, n)
        return self.early.run(lambda a, b, part: early.pack(a, b, [part.done[i] for i in range(a, b)]))

    def measure(self, out: list[Response], start: tuple[ReplicaStatus, ...], wall: float, t_end: float) -> None:
        """Each committed move's measured gain (the module docstring says how)."""
        final = {i: len(tokens) for i, (tokens, _) in enumerate(out)}
        row_s = row_seconds(tuple(self.rows), tuple(self.busy)) or [0.0] * len(self.rows)
        call_s = statistics.fmean(max(0.0, w - b) for w, b in self.chunks) if self.chunks else 0.0
        slots = self.params.slots
        for r in self.committed():
            gain = plain_finish_s(r.seen, final, row_s, slots, call_s) - (t_end - r.at)
            r.outcome = replace(r.outcome, gain_s=gain)
        self.step_gain_s = plain_finish_s(start, final, row_s, slots, call_s) - wall
        self.poll_s = wall - max(self.busy)

    def entries(self) -> tuple[GenerationEntry, ...]:
        return tuple(GenerationEntry(r.status.step, STAGE, r.status.iteration, r.status.live, r.decision, r.outcome,
                                     r.overhead_s) for r in self.recorded)

    def metrics(self) -> dict[str, float]:
        """The step's ``midstep/*`` metrics."""
        moved = [(r.decision, r.outcome) for r in self.committed()]
        return {
            "midstep/decisions": float(len(self.recorded)), "midstep/moves": float(len(moved)),
            "midstep/moved_sequences": float(sum(len(d.moves) for d, _ in moved)),
            "midstep/move_s": float(sum(o.cost_s for _, o in moved)),
            "midstep/predicted_gain_s": float(sum(d.gain_s for d, _ in moved)),
            "midstep/predicted_cost_s": float(sum(d.cost_s for d, _ in moved)),
            "midstep/measured_gain_s": float(sum(o.gain_s for _, o in moved)),
            "midstep/chunks": float(len(self.chunks)),
            "midstep/row_ms": 1e3 * sum(self.busy) / max(1, sum(self.rows)),
            "midstep/step_gain_s": self.step_gain_s, "midstep/poll_s": self.poll_s}


def move_line(e: GenerationEntry) -> str | None:
    """A line of progress for a committed move or a speculation switch (``nereus run`` prints it), else None."""
    d, o = e.decision, e.outcome
    if isinstance(d, SetSpeculation) and o.applied:
        what = (f"on ({d.speculation.draft_tokens} {d.speculation.draft} drafts, while <= "
                f"{d.speculation.live_at_most} live)" if d.speculation else "off")
        return (f"\n  speculation {what} in step {e.step + 1} after iteration {e.iteration}, {e.live} live: "
                f"gain {d.gain_s:.3f} s predicted, cost {d.cost_s:.3f} s predicted; "
                f"{o.figures.get('accepted_tokens', 0):.0f} of {o.figures.get('draft_tokens', 0):.0f} drafts "
                "accepted before it")
    if not (isinstance(d, MoveSequences) and o.applied):
        return None
    return (f"\n  mid-step move in step {e.step + 1} after iteration {e.iteration}: {len(d.moves)} sequences, replica "
            f"{d.donor} -> {d.receiver} ({d.kv} with KV caches, {d.refills} re-prefilled, {d.queued} not started; "
            f"{d.bytes / 1024:.1f} KiB): cost {o.cost_s:.3f} s measured ({d.cost_s:.3f} s predicted); gain "
            f"{d.gain_s:.3f} s predicted, {o.gain_s:+.3f} s measured")
