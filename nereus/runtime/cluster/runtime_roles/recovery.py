"""The driver's recovery operations: host-memory snapshots, lost workers found and recovered from
(``recovery.failover``), faults armed for tests, and each worker's state of a key by global box."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import ray

from nereus.runtime.cluster.runtime_roles.core import RuntimeCore
from nereus.runtime.comm.faults import FaultPlan
from nereus.runtime.hosts.nodes import replica_ring
from nereus.runtime.recovery.failover import RecoveryResult
from nereus.runtime.transitions.live import KeySpec

if TYPE_CHECKING:
    from nereus.runtime.transitions.holdings import Holdings


class RecoveryOps(RuntimeCore):
    """Works through ``failover`` (snapshots, the models changed since the newest one, the calls abandoned
    when a worker was lost), handing it the current ``workers`` and ``specs``; ``recover`` replaces
    ``workers``, ``specs`` and ``nodes`` by the survivors' and clears ``_graphs``."""

    def recover(self, place: Callable[[int], list[KeySpec]], lost: list[int] | None = None) -> RecoveryResult:
        """Continue on the surviving workers: abandon the call in flight, re-form the world, and load
        ``place(n)`` (the ``KeySpec`` of every key for ``n`` survivors, ranks 0..n-1) from live replicas and
        the snapshot. Returns what it did and how long each part took; the state is the snapshot's step's
        (``resume_step``)."""
        from nereus.runtime.recovery.snapshots import StateLostError

        t0 = time.perf_counter()
        lost = sorted(lost if lost is not None else self.lost_workers())
        if not lost:
            raise ValueError("no worker is lost: nothing to recover")
        survivors = [w for r, w in enumerate(self.workers) if r not in lost]
        if not survivors:
            raise StateLostError("every worker is lost: restart from a disk checkpoint (nereus run --resume)")
        old_specs = list(self.specs.values())
        # images are read on nodes known to be up: the survivors' and the driver's (a lost node's, from copies)
        alive = ({h for r, h in enumerate(self.homes) if r not in lost} | {ray.get_runtime_context().get_node_id()}
                 if self.nodes else None)
        dirty = self.failover.recovery_sources(self.workers, old_specs, lost, alive)
        self._all([w.abort.remote() for w in survivors], "abort")
        self.failover.settle_in_flight()
        for r in lost:
            ray.kill(self.workers[r])  # a hung (not dead) worker must not come back into the new world
        n = len(survivors)
        self.workers = survivors
        lost_nodes = self.nodes.drop(lost) if self.nodes else []
        master, port = self._rendezvous()
        self._all([w.reinit.remote(master, port, n, self.timeout_s, i) for i, w in enumerate(survivors)], "reinit")
        t_world = time.perf_counter()
        new_specs = list(place(n))
        for s in new_specs:
            self._check_nodes(s.key, s.layout, list(s.ranks))
        images = self.failover.images(survivors, old_specs, dirty, alive)
        self._all([w.prepare_groups.remote(new_specs) for w in survivors], "prepare_groups")
        self._get([w.restore.remote(new_specs, images) for w in survivors])
        self.specs = {s.key: s for s in new_specs}
        self._graphs.clear()
        self.failover.recovered(node_lost=bool(lost_nodes))
        t1 = time.perf_counter()
        return RecoveryResult(tuple(lost), n, self.failover.snapshot_step, t1 - t0, t_world - t0, t1 - t_world,
                              tuple(sorted({s.model for s in new_specs} - dirty)), tuple(sorted(dirty)),
                              tuple(lost_nodes), self.failover.from_copies)

    def lost_workers(self, timeout_s: float = 10.0) -> list[int]:
        return self.failover.lost_workers(self.workers, timeout_s)

    def inject(self, plan: FaultPlan) -> None:
        """Arm ``plan``'s faults on their workers (tests and benchmarks); nothing else ever arms them."""
        self._all([w.arm_faults.remote(plan.actions_of(r)) for r, w in enumerate(self.workers) if plan.actions_of(r)],
                  "arm_faults")

    # ----- snapshots ---------------------------------------------------------------------------------
    def snapshot(self, step: int) -> float:
        """A host-memory snapshot labelled ``step`` (``Failover.snapshot``); returns the driver's seconds."""
        ring = replica_ring(self.homes, ray.get_runtime_context().get_node_id()) if self.nodes else None
        return self.failover.snapshot(step, self.workers, list(self.specs.values()), self.homes or None, ring)

    def settle_snapshot(self) -> None:
        """Wait until the snapshot being taken is in (``Failover.settle``)."""
        self.failover.settle(self.workers)

    def forget_snapshots(self) -> None:
        self.failover.forget()

    @property
    def snapshot_step(self) -> int | None:
        return self.failover.snapshot_step

    @property
    def latest_snapshot_step(self) -> int | None:
        return self.failover.latest_snapshot_step

    def holdings(self, key: str) -> list[Holdings]:
        """Every worker's state of ``key`` (weights and Adam state) by global box, as ``holdings.Holdings``,
        in layout rank order."""
        from nereus.runtime.recovery.snapshots import unpack

        model = self.specs[key].model
        return [unpack(p) for p in self._get([self.workers[r].holdings.remote(key, model)
                                                for r in self.specs[key].ranks])]
