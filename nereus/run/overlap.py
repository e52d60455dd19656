"""The RL step's worker calls as futures, and what each worker did with its time.

``Calls.submit`` issues one model-stage's operation (a typed request, ``runtime.cluster.calls``) on the
workers of its layout and returns at once;
``Calls.wait`` collects answers. The sequential step waits on each call before issuing the next (today's
behaviour); with ``run.overlap`` the driver issues every independent call of a phase together — all
inference stages, then both models' optimizer steps — so stages on disjoint workers run at the same time
and stages sharing a worker queue on it. Every Ray actor runs the calls it receives in the order they were
issued (``Worker``'s default concurrency group holds one thread), so calls issued in one global order
cannot deadlock on their collectives and each worker computes exactly what it computes sequentially:
the answers are identical, only the waiting changes.

Per-worker accounting is measured by the driver: a worker is *busy* on a call from the moment it can
start it (issued, and its previous call answered) until its answer arrives; a call's busy time includes
waiting inside a collective for a slower peer of the same stage. What is left of the step is *idle*.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
import torch
from ray import ObjectRef

from nereus.runtime.cluster.calls import InferenceCall, KeyCall, ReplicaOutput, by_replica
from nereus.runtime.cluster.workers import Runtime
from nereus.runtime.hosts.waits import GRACE_S, WaitTimeout

# what each kind of call is counted as (metric names: timing_s/worker_<i>/<kind>)
KINDS = ("generate", "infer", "train", "sync")


@dataclass
class Call:
    """One operation issued on every worker of a layout."""

    stage: str  # the driver's timer name (verl's: gen, old_log_prob, ref, values, reward, update_actor...)
    kind: str  # one of KINDS
    refs: dict[int, ObjectRef]  # worker rank -> Ray future, layout rank order
    submitted: float
    done: dict[int, float] = field(default_factory=dict)  # worker rank -> when its answer arrived


@dataclass(frozen=True)
class InferenceStage:
    """One inference stage of the step: its timer (verl's name), the runtime key it runs on, and its
    request, built from the tokens it scores."""

    timer: str
    key: str
    call: InferenceCall
    replays: bool = False  # router replay: its request carries the rows' routes (the actor's old log-probs)

    def request(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None,
                routes: torch.Tensor | None = None) -> object:
        """The stage's request on ``tokens``; ``routes`` where the stage replays them."""
        if self.replays and routes is not None:
            return self.call(tokens, lengths, routes)
        return self.call(tokens, lengths)


class Calls:
    """The futures of one step on runtime ``rt`` (``Runtime.submit``/``Runtime.answers``)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.calls: list[Call] = []

    def reset(self) -> None:
        self.calls = []

    def submit(self, stage: str, kind: str, key: str, request: KeyCall) -> Call:
        """Issue ``request`` on ``key``'s workers, timed as ``stage`` and counted as ``kind``."""
        call = Call(stage, kind, self.rt.submit(key, request), time.perf_counter())
        self.calls.append(call)
        return call

    def wait(self, calls: list[Call]) -> list[list]:
        """Each call's answers by replica, noting when each worker answered. A lost worker or a failed
        call raises as the runtime's own wait does (``Runtime.answers``); past the runtime's deadline,
        ``WaitTimeout``."""
        owner = {ref: (c, rank) for c in calls for rank, ref in c.refs.items() if rank not in c.done}
        refs = [ref for c in calls for ref in c.refs.values()]
        pending = list(owner)
        limit = self.rt.timeout_s + GRACE_S  # the runtime's own deadline for a call (Runtime._get)
        deadline = time.monotonic() + limit
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise WaitTimeout(f"{len(pending)} of {len(refs)} worker calls did not answer within {limit:.0f} s "
                                  "(a worker hung); the run stops here instead of waiting forever")
            call, rank = owner[ready[0]]
            call.done[rank] = time.perf_counter()
            try:
                ray.get(ready[0])
            except Exception:  # noqa: BLE001 - the runtime's wait turns it into WorkerLostError or re-raises
                break
        flat = self.rt.answers(refs)
        out, i = [], 0
        for c in calls:
            out.append(by_replica(flat[i: i + len(c.refs)]))
            i += len(c.refs)
        return out

    def busy(self) -> dict[int, dict[str, float]]:
        """worker rank -> kind -> seconds busy on this step's calls (the module's definition)."""
        out: dict[int, dict[str, float]] = {}
        last: dict[int, float] = {}
        for c in self.calls:
            for rank in c.refs:
                if rank not in c.done:
                    continue
                start = max(c.submitted, last.get(rank, c.submitted))
                out.setdefault(rank, dict.fromkeys(KINDS, 0.0))[c.kind] += max(0.0, c.done[rank] - start)
                last[rank] = c.done[rank]
        return out

    def seconds(self, call: Call) -> float:
        """A call's own duration: from when its first worker could start it to its last answer."""
        starts, prev = [], {}
        for c in self.calls:
            for rank in c.refs:
                if c is call:
                    starts.append(max(c.submitted, prev.get(rank, c.submitted)))
                if rank in c.done:
                    prev[rank] = c.done[rank]
            if c is call:
                break
        return max(call.done.values(), default=call.submitted) - min(starts, default=call.submitted)

    def worker_metrics(self, workers: int, step_s: float, sync_s: float) -> dict[str, float]:
        """``timing_s/worker_<i>/{generate,infer,train,sync,idle}`` and ``perf/idle_fraction/worker_<i>``
        (idle share of the step's wall time, in [0, 1]). Every worker takes part in the weight sync."""
        busy = self.busy()
        m: dict[str, float] = {}
        for w in range(workers):
            b = busy.get(w, dict.fromkeys(KINDS, 0.0))
            b["sync"] = sync_s
            for kind in KINDS:
                m[f"timing_s/worker_{w}/{kind}"] = b[kind]
            idle = max(0.0, step_s - sum(b.values()))
            m[f"timing_s/worker_{w}/idle"] = idle
            m[f"perf/idle_fraction/worker_{w}"] = min(1.0, idle / step_s) if step_s > 0 else 0.0
        return m


def cat_parts(parts: list) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Concatenate replicas' tensors (or tuples of tensors) along the batch."""
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(list(xs)) for xs in zip(*parts, strict=True))
    return torch.cat(parts)


# packs a block of rows (start, stop, a generation replica's answer for them) to the step's fixed width
BlockPacker = Callable[[int, int, list], torch.Tensor]


class EarlyInference:
    """Inference on a generation replica's rows as soon as that replica finishes, on workers that have no
    generation left (``run.overlap`` with ``run.rollout.pad_to_max``).

    A stage takes a finished replica's block of rows early only when every worker of its layout is free
    of generation and the block splits into the very micro-batches the whole batch would: blocks of
    ``per`` rows starting at multiples of ``per``, with ``per`` a multiple of dp × micro_batch_size of the
    stage's layout (``ShardedModel.micro_batches`` cuts each replica's rows into consecutive micro-batches).
    With every rollout padded to one width, each micro-batch then holds the same rows, the same tokens and
    the same weights as in the whole-batch call, so its outputs are the same numbers. (Without the fixed
    width they are not: another padding width changes the attention's rounding.)"""

    def __init__(self, calls: Calls, gen: Call, gen_key: str, stages: tuple[InferenceStage, ...], rows: int) -> None:
        rt = calls.rt
        spec = rt.specs[gen_key]
        lay = spec.layout
        self.calls, self.gen, self.stages = calls, gen, stages
        self.per = rows // lay.dp
        self.replicas = {d: {spec.ranks[i] for i in range(lay.world) if lay.dims.coords(i).dp_rank == d}
                         for d in range(lay.dp)}
        self.early: dict[str, dict[int, Call]] = {s.timer: {} for s in stages}  # timer -> block start -> call

    def eligible(self, key: str) -> bool:
        lay = self.calls.rt.specs[key].layout
        return self.per % (lay.dp * lay.micro_batch_size) == 0

    def run(self, pack_block: BlockPacker) -> list:
        """Wait for generation, issuing early calls; ``pack_block(start, stop, rows)`` packs a block's
        responses to the fixed width. Returns the generation call's answers by replica."""
        owner = {ref: rank for rank, ref in self.gen.refs.items()}
        pending, running = list(owner), set(self.replicas)
        deadline = time.monotonic() + self.calls.rt.timeout_s + GRACE_S
        while pending and len(running) > 1:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise WaitTimeout(f"generation on {len(pending)} workers did not answer within "
                                  f"{self.calls.rt.timeout_s + GRACE_S:.0f} s (a worker hung); the run stops here")
            self.gen.done[owner[ready[0]]] = time.perf_counter()
            try:
                ray.get(ready[0])
            except Exception:  # noqa: BLE001 - raised below by the runtime's wait
                break
            for d in sorted(running):
                if self.replicas[d] <= set(self.gen.done) and len(running) > 1:
                    running.discard(d)
                    self.start(d, running, pack_block)
        return self.calls.wait([self.gen])[0]

    def start(self, d: int, running: set[int], pack_block: BlockPacker) -> None:
        busy = {r for e in running for r in self.replicas[e]}
        ranks = [r for r in self.replicas[d] if r in self.gen.done]
        answer: ReplicaOutput = next(a for r, ref in self.gen.refs.items() if r in ranks
                                     for a in [ray.get(ref)] if a is not None)
        start = d * self.per
        tokens = None
        for s in self.stages:
            # a replaying stage waits for the whole rollout: the routes are packed with it
            if busy & set(self.calls.rt.specs[s.key].ranks) or not self.eligible(s.key) or s.replays:
                continue
            tokens = pack_block(start, start + self.per, answer.value) if tokens is None else tokens
            self.early[s.timer][start] = self.calls.submit(s.timer, "infer", s.key, s.call(tokens))

    def rest(self, stage: InferenceStage, tokens: torch.Tensor, lengths: torch.Tensor | None = None,
             routes: torch.Tensor | None = None) -> list[tuple[int, Call]]:
        """The stage's calls for the rows no early call took, one per run of consecutive blocks; with
        the early ones, (block start, call) in row order. ``lengths``: the rows' real tokens; ``routes``:
        their experts (router replay)."""
        timer, key = stage.timer, stage.key
        taken = self.early[timer]
        if not taken:
            return [(0, self.calls.submit(timer, "infer", key, stage.request(tokens, lengths, routes)))]
        out, run = list(taken.items()), []
        for start in range(0, len(tokens), self.per):
            if start not in taken:
                run.append(start)
            if run and (start in taken or start + self.per >= len(tokens)):
                a, b = run[0], run[-1] + self.per
                part = None if lengths is None else lengths[a:b]
                out.append((a, self.calls.submit(timer, "infer", key, stage.call(tokens[a:b], part))))
                run = []
        return sorted(out, key=lambda x: x[0])
