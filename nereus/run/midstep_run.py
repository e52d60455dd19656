"""One generation call of the RL step with mid-step moves (``run.midstep``): the replicas' engines run in
chunks of iterations; between chunks the controller (``MidStep.decide``) may move unfinished sequences
from one replica to another (``runtime.kv_migrate`` over the workers' world); at the end each admitted
move gets its measured gain (``run.midstep``'s docstring says how it is measured)."""

from __future__ import annotations

import math
import statistics
import time

from nereus.elastic.kvplan import plan_migration
from nereus.run.midstep import Decision, MidStep, Replica, kv_shape, migrate_on_world, placement
from nereus.run.overlap import Calls
from nereus.runtime.sampling import SamplingParams


class GenerationRun:
    """The chunks, decisions and measurements of one step's generation on key ``key``."""

    def __init__(self, ctl: MidStep, calls: Calls, rt: object, key: str, params: SamplingParams, step: int) -> None:
        self.ctl, self.calls, self.rt, self.key, self.params, self.step = ctl, calls, rt, key, params, step
        self.spec = rt.specs[key]
        dp = self.spec.layout.dp
        self.rows, self.busy = [0] * dp, [0.0] * dp
        self.chunks: list[tuple[float, float]] = []  # (driver wall s, slowest replica's busy s) per chunk
        self.iteration = 0
        self.admitted: list[tuple[Decision, list[Replica], float]] = []  # with the state and time it saw

    def _op(self, op: str, *args: object) -> list:
        return self.calls.wait([self.calls.submit("gen", "generate", self.key, op, *args)])[0]

    def run(self, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        self.ctl.decisions, self.ctl.metrics, self.ctl.round_trip_s = [], {}, None
        self._op("gen_open", prompts, self.params)
        while True:
            reps = self.chunk()
            if all(rep.unfinished == 0 for rep in reps):
                break
            self.consider(reps)
        t_end = time.perf_counter()
        done: dict[int, tuple[list[int], list[float]]] = {}
        for part in self._op("gen_close"):
            done.update(part)
        out = [done[i] for i in range(len(prompts))]
        self.measure(out, t_end)
        return out

    def chunk(self) -> list[Replica]:
        t0 = time.perf_counter()
        states = self._op("gen_run", self.ctl.spec.chunk)
        wall = time.perf_counter() - t0
        for d, st in enumerate(states):
            self.rows[d] += st["rows"]
            self.busy[d] += st["busy_s"]
            self.ctl.lengths.extend(st["finished"].values())
        self.chunks.append((wall, max(st["busy_s"] for st in states)))
        self.ctl.round_trip_s = statistics.fmean(max(0.0, w - b) for w, b in self.chunks)
        self.iteration += max(st["iterations"] for st in states)
        return [Replica(d, st["active"], st["queued"]) for d, st in enumerate(states)]

    def row_s(self) -> list[float]:
        """Measured seconds per row of each replica in this step (the step's mean where one ran none)."""
        total = sum(self.busy) / max(1, sum(self.rows))
        return [b / r if r else total for b, r in zip(self.busy, self.rows, strict=True)]

    def consider(self, reps: list[Replica]) -> None:
        shape = kv_shape(self.spec)
        got = self.ctl.decide(self.step + 1, self.iteration, reps, self.row_s(), self.params.slots,
                              self.params.max_new_tokens, shape)
        if got is None:
            return
        d, moves = got
        self.ctl.decisions.append(d)
        if not d.admitted:
            return
        t0 = time.perf_counter()
        where = placement(self.spec)
        plan = plan_migration(self.spec.model, shape, where, where, moves)
        answers = migrate_on_world(self.calls, self.rt, self.key, plan.to_json())
        d.move_s = time.perf_counter() - t0
        failed = [a["error"] for a in answers if not a["ok"]]
        if failed:  # nothing moved: every sequence is still where it was (kv_migrate's commit point)
            d.reason += f"; aborted, nothing moved: {failed[0][:300]}"
            return
        d.committed = True
        self.ctl.moves_measured.append((d.bytes, d.move_s))
        self.admitted.append((d, reps, t0))

    def measure(self, out: list[tuple[list[int], list[float]]], t_end: float) -> None:
        """Each committed move's measured gain (the no-move replay from its decision point, in this step's
        measured seconds per row plus driver overhead per chunk, minus the measured wall time) and the
        step's ``midstep/*`` metrics."""
        final = {i: len(tokens) for i, (tokens, _) in enumerate(out)}
        row_s, slots, chunk = self.row_s(), self.params.slots, self.ctl.spec.chunk
        overhead = statistics.fmean(max(0.0, w - b) for w, b in self.chunks)
        for d, reps, t in self.admitted:
            works = [(rep.work(final, slots), rep.dp) for rep in reps]
            its = max(w[1] for w, _ in works)
            counterfactual = max(w[0] * row_s[dp] for w, dp in works) + math.ceil(its / chunk) * overhead
            d.measured_gain_s = counterfactual - (t_end - t)
        moved = [d for d in self.ctl.decisions if d.committed]
        self.ctl.metrics = {
            "midstep/decisions": float(len(self.ctl.decisions)), "midstep/moves": float(len(moved)),
            "midstep/moved_sequences": float(sum(len(d.moved) for d in moved)),
            "midstep/move_s": float(sum(d.move_s for d in moved)),
            "midstep/predicted_gain_s": float(sum(d.predicted_gain_s for d in moved)),
            "midstep/predicted_cost_s": float(sum(d.predicted_cost_s for d in moved)),
            "midstep/measured_gain_s": float(sum(d.measured_gain_s for d in moved)),
            "midstep/chunks": float(len(self.chunks)), "midstep/row_ms": 1e3 * sum(self.busy) / max(1, sum(self.rows))}


def generate_midstep(ctl: MidStep, calls: Calls, rt: object, key: str, prompts: list[list[int]],
                     params: SamplingParams, step: int) -> list[tuple[list[int], list[float]]]:
    """``generate_with_logprobs``'s answer for ``prompts`` on key ``key``, run in chunks with mid-step moves."""
    return GenerationRun(ctl, calls, rt, key, params, step).run(prompts)
