"""One generation call of the RL step with mid-step moves (``run.midstep``): the replicas' engines run in
chunks of iterations, each sized by the controller (``MidStep.next_look``); between chunks the controller
(``MidStep.decide``) may move unfinished sequences from one replica to another (``runtime.generation.kv_migrate`` over
the workers' world); once no move can be admitted any more the final call runs every replica to the end and
answers; at the end each admitted move gets its measured gain (``run.midstep``'s docstring says how it is
measured). With ``run.overlap`` and ``pad_to_max``, inference starts on a finished replica's rows during
that final call, as on the plain engine (``EarlyInference``), when no move changed which rows a replica holds."""

from __future__ import annotations

import statistics
import time

from nereus.elastic.kvplan import plan_migration
from nereus.run.midstep import Decision, MidStep, Replica, kv_shape, migrate_on_world, placement
from nereus.run.overlap import BlockPacker, Calls, EarlyInference, InferenceStage
from nereus.runtime.cluster.calls import GenClose, GenOpen, GenRun, KeyCall
from nereus.runtime.cluster.workers import Runtime
from nereus.runtime.generation.sampling import SamplingParams

# ``Stepper.generate``'s early inference: the inference stages, and the packer of a block of rows (start,
# stop, [(tokens, log-probs)] in row order) to the step's fixed width
Early = tuple[list[InferenceStage], BlockPacker]


class GenerationRun:
    """The chunks, decisions and measurements of one step's generation on key ``key``."""

    def __init__(self, ctl: MidStep, calls: Calls, rt: Runtime, key: str, params: SamplingParams, step: int) -> None:
        self.ctl, self.calls, self.rt, self.key, self.params, self.step = ctl, calls, rt, key, params, step
        self.spec = rt.specs[key]
        dp = self.spec.layout.dp
        self.rows, self.busy = [0] * dp, [0.0] * dp
        self.chunks: list[tuple[float, float]] = []  # (driver wall s, slowest replica's busy s) per chunk
        self.iteration = 0
        self.admitted: list[tuple[Decision, list[Replica], float]] = []  # with the state and time it saw
        self.seen: set[int] = set()  # sequences whose final length the forecast history holds already
        self.early: EarlyInference | None = None  # the final call's early inference, when it ran

    def _op(self, request: KeyCall) -> list:
        return self.calls.wait([self.calls.submit("gen", "generate", self.key, request)])[0]

    def run(self, prompts: list[list[int]], early: Early | None = None) -> list[tuple[list[int], list[float]]]:
        self.ctl.decisions, self.ctl.metrics, self.ctl.round_trip_s = [], {}, None
        slots, limit = self.params.slots, self.params.max_new_tokens
        t_open = time.perf_counter()
        self._op(GenOpen(prompts, self.params))
        start = reps = self.queued(prompts)
        look = self.ctl.next_look(reps, None, slots, limit)
        while look is not None:
            reps = self.chunk(look)
            if all(rep.unfinished == 0 for rep in reps):
                break
            # after a committed move the status is stale: look again after ``chunk`` iterations
            look = self.ctl.spec.chunk if self.consider(reps) else self.ctl.next_look(reps, self.row_s(), slots, limit)
        done: dict[int, tuple[list[int], list[float]]] = {}
        for d, part in enumerate(self.finish(len(prompts), early)):
            self.account(d, part)
            done.update(part["done"])
        t_end = time.perf_counter()
        self.ctl.lengths.extend(len(done[i][0]) for i in sorted(set(done) - self.seen))
        out = [done[i] for i in range(len(prompts))]
        self.measure(out, start, t_end - t_open, t_end)
        return out

    def queued(self, prompts: list[list[int]]) -> list[Replica]:
        """Every replica's status before its first iteration: its block of rows queued (``gen_open``: the
        rows ``ShardedModel.replica_rows`` gives it, consecutive blocks in DP order)."""
        dp = self.spec.layout.dp
        per = len(prompts) // dp
        return [Replica(d, [], [[i, len(prompts[i]), 0, 0, 0] for i in range(d * per, (d + 1) * per)])
                for d in range(dp)]

    def account(self, d: int, st: dict) -> None:
        """Replica ``d``'s rows and busy seconds of one call (``gen_session.run_chunk``/``close_engine``)."""
        self.rows[d] += st["rows"]
        self.busy[d] += st["busy_s"]

    def chunk(self, iterations: int) -> list[Replica]:
        t0 = time.perf_counter()
        states = self._op(GenRun(iterations))
        wall = time.perf_counter() - t0
        for d, st in enumerate(states):
            self.account(d, st)
            self.ctl.lengths.extend(st["finished"].values())
            self.seen.update(st["finished"])
        self.chunks.append((wall, max(st["busy_s"] for st in states)))
        self.ctl.round_trip_s = statistics.fmean(max(0.0, w - b) for w, b in self.chunks)
        self.iteration += max(st["iterations"] for st in states)
        return [Replica(d, st["active"], st["queued"]) for d, st in enumerate(states)]

    def finish(self, n: int, early: Early | None) -> list[dict]:
        """The final call: every replica runs to the end and answers its sequences (``gen_close``). Early
        inference takes a finished replica's block only when no move committed in this step, so that the
        replica's answer holds exactly its block of rows, the very rows the plain engine's call answers."""
        call = self.calls.submit("gen", "generate", self.key, GenClose())
        if early is None or any(d.committed for d in self.ctl.decisions):
            return self.calls.wait([call])[0]
        stages, pack_block = early
        self.early = EarlyInference(self.calls, call, self.key, stages, n)
        return self.early.run(lambda a, b, part: pack_block(a, b, [part["done"][i] for i in range(a, b)]))

    def row_s(self) -> list[float] | None:
        """Measured seconds per row of each replica in this step (the step's mean where one ran none);
        None before any row ran."""
        if not sum(self.rows):
            return None
        total = sum(self.busy) / sum(self.rows)
        return [b / r if r else total for b, r in zip(self.busy, self.rows, strict=True)]

    def consider(self, reps: list[Replica]) -> bool:
        """Decide on the status ``reps``; True when a move committed (then ``reps`` is stale)."""
        shape = kv_shape(self.spec)
        got = self.ctl.decide(self.step + 1, self.iteration, reps, self.row_s(), self.params.slots,
                              self.params.max_new_tokens, shape)
        if got is None:
            return False
        d, moves = got
        self.ctl.decisions.append(d)
        if not d.admitted:
            return False
        t0 = time.perf_counter()
        where = placement(self.spec)
        plan = plan_migration(self.spec.model, shape, where, where, moves)
        answers = migrate_on_world(self.calls, self.rt, self.key, plan.to_json())
        d.move_s = time.perf_counter() - t0
        failed = [a["error"] for a in answers if not a["ok"]]
        if failed:  # nothing moved: every sequence is still where it was (kv_migrate's commit point)
            d.reason += f"; aborted, nothing moved: {failed[0][:300]}"
            return False
        d.committed = True
        self.ctl.moves_measured.append((d.bytes, d.move_s))
        self.admitted.append((d, reps, t0))
        return True

    def plain(self, reps: list[Replica], final: dict[int, int], row_s: list[float], call_s: float) -> float:
        """Predicted seconds of the plain engine from status ``reps`` with final lengths ``final``: every
        replica run to the end in one call, the slowest replica's rows × its seconds per row plus one
        call's driver overhead."""
        slots = self.params.slots
        return max(rep.work(final, slots)[0] * row_s[rep.dp] for rep in reps) + call_s

    def measure(self, out: list[tuple[list[int], list[float]]], start: list[Replica], wall: float,
                t_end: float) -> None:
        """Each committed move's measured gain, the step's (``run.midstep``'s docstring says how both are
        measured; ``start``: the replicas' status before the first iteration, ``wall``: the generation's
        wall time) and the step's other ``midstep/*`` metrics."""
        final = {i: len(tokens) for i, (tokens, _) in enumerate(out)}
        row_s = self.row_s() or [0.0] * len(self.rows)
        call_s = statistics.fmean(max(0.0, w - b) for w, b in self.chunks) if self.chunks else 0.0
        for d, reps, t in self.admitted:
            d.measured_gain_s = self.plain(reps, final, row_s, call_s) - (t_end - t)
        moved = [d for d in self.ctl.decisions if d.committed]
        self.ctl.metrics = {
            "midstep/decisions": float(len(self.ctl.decisions)), "midstep/moves": float(len(moved)),
            "midstep/moved_sequences": float(sum(len(d.moved) for d in moved)),
            "midstep/move_s": float(sum(d.move_s for d in moved)),
            "midstep/predicted_gain_s": float(sum(d.predicted_gain_s for d in moved)),
            "midstep/predicted_cost_s": float(sum(d.predicted_cost_s for d in moved)),
            "midstep/measured_gain_s": float(sum(d.measured_gain_s for d in moved)),
            "midstep/chunks": float(len(self.chunks)), "midstep/row_ms": 1e3 * sum(self.busy) / max(1, sum(self.rows)),
            "midstep/step_gain_s": self.plain(start, final, row_s, call_s) - wall,
            "midstep/poll_s": wall - max(self.busy)}


def generate_midstep(ctl: MidStep, calls: Calls, rt: Runtime, key: str, prompts: list[list[int]],
                     params: SamplingParams, step: int, early: Early | None = None,
                     ) -> tuple[list[tuple[list[int], list[float]]], EarlyInference | None]:
    """``generate_with_logprobs``'s answer for ``prompts`` on key ``key``, run in chunks with mid-step moves,
    and the early inference its final call started (None when it started none)."""
    run = GenerationRun(ctl, calls, rt, key, params, step)
    return run.run(prompts, early), run.early
