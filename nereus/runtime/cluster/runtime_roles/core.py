"""What every role of the driver-side ``Runtime`` shares: the Ray workers joined into one world, the
record of what each key holds, and the calls to the workers with the runtime's deadline and lost-worker
detection.

Driver-side calls are typed requests (``calls``): ``submit`` issues one on every worker of a key's layout,
``submit_all`` on every worker of the world, and each request calls its ``Worker`` method by name.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import ray
import torch
from ray import ObjectRef
from ray.actor import ActorHandle

from nereus.runtime.cluster.calls import KeyCall, WorldCall, by_replica
from nereus.runtime.cluster.worker import Worker
from nereus.runtime.hosts.address import check_address
from nereus.runtime.hosts.nodes import (
    NodeMap,
    PlacementError,
    pinned,
    several_nodes,
    start_store,
    tp_split,
    world_address,
)
from nereus.runtime.hosts.raylocal import start_local_ray
from nereus.runtime.hosts.waits import GRACE_S, get_within
from nereus.runtime.recovery.failover import Failover
from nereus.runtime.transitions.live import KeySpec
from nereus.spec.layout import Layout

if TYPE_CHECKING:
    from nereus.elastic.plan import TransitionPlan


class RuntimeCore:
    """The runtime's world and the state every role uses, initialised here only:

    * ``workers``: the Ray actors by rank; ``nodes``: where they live on a cluster of several nodes (None
      on one); ``backend``: the world's torch.distributed backend;
    * ``specs``: key → ``KeySpec``, the one record of what each key holds;
    * ``failover``: the snapshots, the models changed since the newest one and the abandoned calls;
    * ``_graphs``: the transition graphs built so far (a re-formed world clears them);
    * ``timeout_s``, ``start_timeout_s``, ``worker_options``, ``_store``, ``_store_dir``: deadlines, the
      workers' Ray resources and where worlds meet.
    """

    def __init__(self, world: int, address: str | None = None, temp_dir: str | Path | None = None,
                 timeout_s: float = 600.0, max_workers: int | None = None) -> None:
        gpu = torch.cuda.is_available()
        self._store_dir = None if address else Path(temp_dir or Path.cwd() / ".tmp" / "ray").absolute() / "rendezvous"
        if not ray.is_initialized():
            if address:
                # a one-line error at once, not minutes of ray.init retries; the address Ray itself will use
                ray.init(address=check_address(address))
            else:
                root = Path(temp_dir or Path.cwd() / ".tmp" / "ray").absolute()
                start_local_ray(max(world, max_workers or 0, os.cpu_count() or 1), root)
        self.timeout_s = timeout_s
        self.start_timeout_s = min(timeout_s, GRACE_S)  # for a joining worker to be placed and answer
        self.worker_options = {"num_gpus": 1} if gpu else {"num_cpus": 1}
        # a cluster: workers pinned to nodes (TP groups inside one; too few slots refused at once rather than
        # left pending), worlds meet at the head node's store
        self.nodes = NodeMap("GPU" if gpu else "CPU") if address or several_nodes() else None
        self._store = start_store(min(timeout_s, 60.0)) if address or self.nodes else None
        self.workers = self._new_workers(0, world, world)
        master, port = self._rendezvous()
        self.backend = self._all([w.init_dist.remote(master, port, timeout_s) for w in self.workers], "init_dist")[0]
        self._all([w.init_comm.remote(min(timeout_s, 120.0)) for w in self.workers], "init_comm")
        self.specs: dict[str, KeySpec] = {}  # what each key holds: the one record of placements
        self._graphs: dict[tuple, TransitionPlan] = {}
        self.failover = Failover()
        self.failover.timeout_s = timeout_s + GRACE_S  # snapshot waits too have a deadline

    # ----- the workers and where they live ------------------------------------------------------------
    def _new_workers(self, first: int, count: int, world: int) -> list[ActorHandle]:
        """Ray actors for ranks ``first``..``first + count - 1`` of a world of ``world``; on several nodes
        each pinned to the node ``NodeMap.place`` gives it (``PlacementError`` when the cluster lacks room)."""
        homes = self.nodes.place(count) if self.nodes else [None] * count
        return [Worker.options(**self.worker_options, **(pinned(h) if h else {})).remote(first + i, world)
                for i, h in enumerate(homes)]

    @property
    def homes(self) -> list[str]:
        """Each worker's Ray node id, by rank (empty on a single node)."""
        return list(self.nodes.homes) if self.nodes else []

    def _rendezvous(self) -> tuple[str, int]:
        """Where a new world meets: a fresh prefix of the head node's store on a cluster, a fresh file under
        Ray's temp folder when Ray is local (nothing listens), else a free port on worker 0's host."""
        if self._store is not None:
            return world_address(self._store), 0
        if self._store_dir is not None:
            self._store_dir.mkdir(parents=True, exist_ok=True)
            return f"file://{self._store_dir / f'world-{uuid.uuid4().hex}'}", 0
        return self._all([self.workers[0].address.remote()], "address")[0]

    def _check_nodes(self, key: str, layout: Layout, ranks: list[int]) -> None:
        """Refuse a layout whose TP group would cross nodes (``nodes.tp_split``), naming it."""
        why = tp_split(layout, ranks, self.homes)
        if why:
            raise PlacementError(why, f"run.layouts.{key}")

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []
        if self._store is not None:
            ray.kill(self._store)
            self._store = None

    # ----- calls to the workers -----------------------------------------------------------------------
    def submit(self, key: str, call: KeyCall) -> dict[int, ObjectRef]:
        """Issue ``call`` on every worker of ``key``'s layout without waiting: worker rank → Ray future, in
        layout rank order. Each actor runs its calls in the order they were issued, so calls issued in one
        global order never deadlock on their collectives; ``answers`` waits. A call that changes its
        model's state (``changes_state``) leaves the model's snapshot behind (``Failover.changed``)."""
        if call.changes_state:
            self.failover.changed(self.specs[key].model)
        return {r: call.issue(self.workers[r], key) for r in self.specs[key].ranks}

    def submit_all(self, call: WorldCall) -> dict[int, ObjectRef]:
        """Issue ``call`` on every worker of the world (a call with a world-wide collective, such as a
        migration's commit vote), like ``submit``: worker rank → Ray future."""
        return {r: call.issue(w) for r, w in enumerate(self.workers)}

    def answers(self, refs: list[ObjectRef]) -> list:
        """The answers of ``submit``'s futures, with the runtime's deadline and lost-worker detection."""
        return self._get(refs)

    def _on(self, key: str, call: KeyCall) -> list:
        """``call`` on every worker of ``key``'s layout (all together, as collectives need); the output
        ranks' values in data-parallel order."""
        return by_replica(self.answers(list(self.submit(key, call).values())))

    def _get(self, refs: list[ObjectRef]) -> list:
        return self.failover.get(self.workers, refs, self.timeout_s + GRACE_S)

    def _all(self, refs: list[ObjectRef], what: str) -> list:
        """Every answer of a call to the workers, within the runtime's deadline (``waits.get_within``)."""
        return get_within(refs, self.timeout_s + GRACE_S, what)
