"""The driver's transition operations: keys moved live to new layouts and workers, the per-step weight
sync from the training key, and workers joining or leaving with the state kept."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import ray

from nereus.runtime.cluster.runtime_roles.core import RuntimeCore
from nereus.runtime.hosts.waits import await_started, check_room
from nereus.runtime.transitions.live import KeySpec, MoveResult, TransitionAnswer
from nereus.spec.job import JobSpec

if TYPE_CHECKING:
    from nereus.elastic.plan import TransitionPlan


def _world_job(job: JobSpec, world: int) -> JobSpec:
    """The job on the runtime's ``world`` devices; a count that is not whole nodes (survivors of a lost
    worker) counts as one node of that many."""
    from dataclasses import replace

    if world <= job.cluster.gpus_per_node or world % job.cluster.gpus_per_node == 0:
        return job.with_gpus(world)
    return replace(job, cluster=replace(job.cluster, nodes=1, gpus_per_node=world))


class TransitionOps(RuntimeCore):
    """Moves keys as the transition graph between two placements says (built once per pair of placements
    and kept in ``_graphs``), updating ``specs``; ``resize`` changes ``workers`` (and ``nodes``) and
    re-forms the world around the same shards."""

    def transition(self, new_specs: list[KeySpec], job: JobSpec) -> MoveResult:
        """Move the keys of ``new_specs`` (all currently loaded) to their new layouts and workers, weights and
        Adam state, following the transition graph; other keys are untouched. Returns the per-worker
        measurements and the graph; raises ``TransitionExecutionError`` (every worker still on the old
        layout) on failure."""
        old_specs = [self.specs[s.key] for s in new_specs]
        for s in new_specs:
            self._check_nodes(s.key, s.layout, list(s.ranks))
        out = self._move(job, old_specs, new_specs, old_specs)
        for s in new_specs:
            self.specs[s.key] = s
        return out

    def sync_weights(self, model: str, job: JobSpec) -> MoveResult:
        """The training key's weights to every other key of ``model`` (the per-step training → generation
        and inference sync), through the same executor: boxes that coincide on a device become one shared
        tensor, the rest move point to point. Where every worker's shards of the other keys already are
        the training shards' memory (a sync left them so, and Adam updates in place), nothing moves: one
        question to the workers instead of the executor's collectives (a ``MoveResult`` without graph)."""
        train = next(s for s in self.specs.values() if s.model == model and s.training)
        keys = [train] + [s for s in self.specs.values() if s.model == model and not s.training]
        if len(keys) == 1:
            return MoveResult(0.0)
        start = time.perf_counter()
        others = [s.key for s in keys[1:]]
        if all(self._get([w.follows.remote(train.key, others) for w in self.workers])):
            return MoveResult(time.perf_counter() - start)
        return self._move(job, keys, keys, [train])

    def _move(self, job: JobSpec, old_specs: list[KeySpec], new_specs: list[KeySpec],
              sources: list[KeySpec]) -> MoveResult:
        """Groups ahead, then every worker replaces the keys of ``old_specs`` by ``new_specs``, state read from
        the keys of ``sources``, as the (cached) graph between the two says."""
        from nereus.runtime.comm.transfer import TransitionExecutionError

        graph = self._graph(job, sources, new_specs)
        self._all([w.prepare_groups.remote(new_specs) for w in self.workers], "prepare_groups")
        results: list[TransitionAnswer] = self._get([w.transition.remote(graph, old_specs, new_specs, sources)
                                                     for w in self.workers])
        if not all(r.ok for r in results):
            raise TransitionExecutionError(next(r.error for r in results if not r.ok))
        return MoveResult(max(r.wall_s for r in results), tuple(r.measured for r in results), graph)

    def _graph(self, job: JobSpec, old: list[KeySpec], new: list[KeySpec]) -> TransitionPlan:
        from nereus.elastic.graph import build_graph
        from nereus.runtime.transitions.live import plan_of

        key = (tuple(old), tuple(new))
        if key not in self._graphs:
            world = len(self.workers)
            self._graphs[key] = build_graph(_world_job(job, world), plan_of(old, world), plan_of(new, world))
        return self._graphs[key]

    def resize(self, n: int) -> None:
        """Grow or shrink to ``n`` workers without losing state: new Ray actors join (or the highest-ranked
        ones, which must hold nothing — transition off them first — are stopped), every worker joins a
        fresh torch.distributed world of ``n`` and rebuilds its shards on new groups around the same
        tensors. Workers keep their ranks."""
        cur = len(self.workers)
        if n == cur:
            return
        if n < 1:
            raise ValueError(f"cannot resize to {n} workers")
        busy = sorted({s.key for s in self.specs.values() if max(s.ranks) >= n})
        if busy:
            raise ValueError(f"workers {n}..{cur - 1} still hold {busy}: transition off them before shrinking")
        if n < cur:
            for w in self.workers[n:]:
                ray.kill(w)
            self.workers = self.workers[:n]
            if self.nodes:
                self.nodes.truncate(n)
        else:  # a join Ray cannot place fails here, before any worker leaves its world
            if not self.nodes:
                check_room(n, self.worker_options, cur)
            new = self._new_workers(cur, n - cur, n)
            await_started(new, self.start_timeout_s)
            self.workers += new
        master, port = self._rendezvous()
        self._all([w.reinit.remote(master, port, n, self.timeout_s) for w in self.workers], "reinit")
        self._all([w.regroup.remote(list(self.specs.values())) for w in self.workers], "regroup")
        self._graphs.clear()
