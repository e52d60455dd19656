"""The runtime: Ray actors (``worker.Worker``), one per device, joined into one torch.distributed world;
models load onto them under a layout, several layouts coexisting (each under its own key, with its own
process groups). Its methods are typed: each names one operation and returns its result.

Driver-side calls are typed requests (``calls``): ``submit`` issues one on every worker of a key's layout,
``submit_all`` on every worker of the world, and each request calls its ``Worker`` method by name.

``Runtime`` starts a local Ray instance by default (loopback only, no dashboard) or joins the cluster at
``address``. On a cluster of several nodes (``nodes``) workers are pinned to nodes so that TP groups stay
inside one, worlds meet at a store on the head node, and snapshots are copied to a second node. Workers
use gloo on CPU and NCCL with one GPU each when CUDA is present. Every call that creates groups goes to
all workers, because torch.distributed creates each group collectively.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import ray
import torch
from ray import ObjectRef
from ray.actor import ActorHandle

from nereus.runtime.capability import CAPABILITY
from nereus.runtime.cluster.calls import (
    Generate,
    GenerateWithLogprobs,
    KeyCall,
    Logprobs,
    LogprobsAndEntropy,
    TrainStep,
    Values,
    WorldCall,
    by_replica,
)
from nereus.runtime.cluster.worker import Worker, WorldAborted
from nereus.runtime.comm.faults import FaultPlan
from nereus.runtime.engines.sampling import SamplingParams
from nereus.runtime.hosts.address import check_address
from nereus.runtime.hosts.nodes import (
    NodeMap,
    PlacementError,
    pinned,
    replica_ring,
    several_nodes,
    start_store,
    tp_split,
    world_address,
)
from nereus.runtime.hosts.raylocal import start_local_ray
from nereus.runtime.hosts.waits import GRACE_S, await_started, check_room, get_within
from nereus.runtime.model.decoder import ModelConfig
from nereus.runtime.model.memory import MemoryReport
from nereus.runtime.parallel.sharded import Batch, LossFn, TrainStats
from nereus.runtime.recovery.failover import Failover, RecoveryResult, WorkerLostError
from nereus.runtime.transitions.live import KeySpec, MoveResult, TransitionAnswer
from nereus.spec.job import JobSpec
from nereus.spec.layout import Layout

if TYPE_CHECKING:
    from nereus.elastic.plan import TransitionPlan
    from nereus.runtime.engines.engine_pool import EnginesOpened
    from nereus.runtime.engines.vllm_engine import EngineConfig
    from nereus.runtime.transitions.holdings import Holdings

__all__ = ["PlacementError", "Runtime", "Worker", "WorkerLostError", "WorldAborted"]


def _world_job(job: JobSpec, world: int) -> JobSpec:
    """The job on the runtime's ``world`` devices; a count that is not whole nodes (survivors of a lost
    worker) counts as one node of that many."""
    from dataclasses import replace

    if world <= job.cluster.gpus_per_node or world % job.cluster.gpus_per_node == 0:
        return job.with_gpus(world)
    return replace(job, cluster=replace(job.cluster, nodes=1, gpus_per_node=world))


class Runtime:
    """``world`` workers (Ray actors) in one process group; ``load`` places a model under a layout. A lost
    worker raises ``WorkerLostError``; ``recover`` continues on the survivors (``failover``).
    ``capability`` says which layouts it runs; ``specs`` (key → ``KeySpec``) is what each key holds."""

    capability = CAPABILITY

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

    def load(self, key: str, cfg: ModelConfig, layout: Layout, ranks: list[int] | None = None,
             checkpoint: str | Path | None = None, state: dict | None = None, dtype: str = "float32",
             schedule: str = "1f1b", model: str | None = None, stage: str | None = None) -> None:
        """Place ``cfg``'s model under ``layout`` on workers ``ranks`` (default the first ``layout.world``),
        each reading its boxes from an HF ``checkpoint`` directory or cutting them from whole ``state``.
        ``model``/``stage`` name what the key holds in a plan (default: from a key "model/stage")."""
        ranks = list(range(layout.world)) if ranks is None else list(ranks)
        self._check_nodes(key, layout, ranks)
        ckpt = str(checkpoint) if checkpoint else None
        self._all([w.load.remote(key, cfg, layout, ranks, ckpt, state, dtype, schedule) for w in self.workers],
                  f"load {key}")
        head, _, tail = key.partition("/")
        self.specs[key] = KeySpec(key, model or head, stage or tail or "inference", cfg, layout, tuple(ranks), dtype)

    def _check_nodes(self, key: str, layout: Layout, ranks: list[int]) -> None:
        """Refuse a layout whose TP group would cross nodes (``nodes.tp_split``), naming it."""
        why = tp_split(layout, ranks, self.homes)
        if why:
            raise PlacementError(why, f"run.layouts.{key}")

    # ----- live transitions -----------------------------------------------------------------------
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

    def _graph(self, job: JobSpec, old: list[KeySpec], new: list[KeySpec]) -> TransitionPlan:
        from nereus.elastic.graph import build_graph
        from nereus.runtime.transitions.live import plan_of

        key = (tuple(old), tuple(new))
        if key not in self._graphs:
            world = len(self.workers)
            self._graphs[key] = build_graph(_world_job(job, world), plan_of(old, world), plan_of(new, world))
        return self._graphs[key]

    # ----- operations on a key --------------------------------------------------------------------
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

    def logprobs(self, key: str, tokens: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._on(key, Logprobs(tokens)))

    def logprobs_and_entropy(self, key: str, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and full-vocabulary entropies [B, T−1] from one forward pass (verl's old_log_prob
        stage computes both)."""
        parts = self._on(key, LogprobsAndEntropy(tokens))
        return torch.cat([lp for lp, _ in parts]), torch.cat([h for _, h in parts])

    def values(self, key: str, tokens: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._on(key, Values(tokens)))

    def train_step(self, key: str, batch: Batch, loss_fn: LossFn, lr: float = 1e-3,
                   max_grad_norm: float | None = None, weight_decay: float = 0.0) -> TrainStats:
        """One optimizer step; ``max_grad_norm`` clips the global gradient norm first, ``weight_decay`` is
        AdamW's decoupled decay (``ShardedModel.step``). Returns each replica's losses, loss statistics and
        gradient norm."""
        return TrainStats(tuple(self._on(key, TrainStep(batch, loss_fn, lr, max_grad_norm, weight_decay))))

    def generate(self, key: str, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        return [row for part in self._on(key, Generate(prompts, params)) for row in part]

    def generate_with_logprobs(self, key: str, prompts: list[list[int]],
                               params: SamplingParams) -> list[tuple[list[int], list[float]]]:
        """New tokens and their sampling-time log-probs per prompt (``generate.generate_with_logprobs``)."""
        return [row for part in self._on(key, GenerateWithLogprobs(prompts, params)) for row in part.rows]

    # ----- vLLM engines of a generation key (run.rollout.engine: vllm; runtime.engines.vllm_engine) -----
    def open_engine(self, key: str, config: EngineConfig) -> EnginesOpened:
        """One vLLM engine per data-parallel replica of ``key`` (pp=1; the engine's TP size is the layout's,
        ``config.tp``), loaded with the key's weights: a worker's idle engine of ``config`` where it has one
        (``engine_pool``), else a new one; from then on ``generate_with_logprobs`` on ``key`` generates with
        them. After a recovery or a transition the caller opens them again on the new layout (a re-formed
        world closes them). An engine's start has its own deadline (``ENGINE_START_S``): importing vLLM
        alone takes 10–30 s."""
        from nereus.runtime.engines.engine_pool import EnginesOpened
        from nereus.runtime.engines.vllm_engine import ENGINE_START_S

        refs = [self.workers[r].engine_open.remote(key, config) for r in self.specs[key].ranks]
        return EnginesOpened.of(self.failover.get(self.workers, refs, max(self.timeout_s, ENGINE_START_S)))

    def close_engine(self, key: str) -> None:
        """Every worker's engine of ``key`` closed (a transition moved the key: engines open anew on it)."""
        self._all([w.close_engines.remote([key]) for w in self.workers], "close_engines")

    def update_engine(self, key: str) -> float:
        """The key's current weights into its engines in place (after ``sync_weights``); the slowest
        engine's reload seconds."""
        seconds = self._get([self.workers[r].engine_update.remote(key) for r in self.specs[key].ranks])
        return max((t for t in seconds if t is not None), default=0.0)

    def engine_tensors(self, key: str) -> list[dict[str, torch.Tensor] | None]:
        """Each worker's engine parameters in the engine's own layout, in layout rank order (tests)."""
        return self._get([self.workers[r].engine_tensors.remote(key) for r in self.specs[key].ranks])

    def memory(self, key: str) -> list[MemoryReport | None]:
        """The last operation's memory report of every worker of ``key``'s layout, in layout rank order."""
        return self._all([self.workers[r].memory.remote(key) for r in self.specs[key].ranks], "memory")

    def shard_shapes(self, key: str) -> list[dict[str, tuple[int, ...]] | None]:
        return self._all([self.workers[r].shard_shapes.remote(key) for r in self.specs[key].ranks], "shard_shapes")

    # ----- state (checkpoints, tests) ----------------------------------------------------------------
    def read_weights(self, key: str) -> dict[str, torch.Tensor]:
        """``key``'s whole weights by checkpoint name, assembled from its shards."""
        from nereus.runtime.parallel.shard_state import assemble

        return assemble(self._get([self.workers[r].read_shards.remote(key) for r in self.specs[key].ranks]))

    def read_optimizer(self, key: str) -> dict[int, dict[str, torch.Tensor]]:
        """worker rank → its Adam state of ``key`` (``shard_state.read_optimizer``); ranks without one yet
        (no step taken) are left out."""
        states = self._get([self.workers[r].read_optimizer.remote(key) for r in self.specs[key].ranks])
        return {r: st for r, st in zip(self.specs[key].ranks, states, strict=True) if st is not None}

    def write_optimizer(self, key: str, states: dict[int, dict[str, torch.Tensor]], lr: float) -> None:
        """Install what ``read_optimizer`` returned, under the same layout on the same workers; raises
        ``ValueError`` naming what does not match."""
        ranks = self.specs[key].ranks
        if set(states) != set(ranks):
            raise ValueError(f"optimizer state of workers {sorted(states)} for {key!r}, whose layout runs on "
                             f"{sorted(ranks)}: resume under the layout the checkpoint was written with")
        self._get([self.workers[r].write_optimizer.remote(key, states[r], lr) for r in ranks])

    def holdings(self, key: str) -> list[Holdings]:
        """Every worker's state of ``key`` (weights and Adam state) by global box, as ``holdings.Holdings``,
        in layout rank order."""
        from nereus.runtime.recovery.snapshots import unpack

        model = self.specs[key].model
        return [unpack(p) for p in self._get([self.workers[r].holdings.remote(key, model)
                                                for r in self.specs[key].ranks])]

    # ----- failover -------------------------------------------------------------------------------
    def recover(self, place: Callable[[int], list[KeySpec]], lost: list[int] | None = None) -> RecoveryResult:
        """Continue on the surviving workers: abandon the call in flight, re-form the world, and load
        ``place(n)`` (the ``KeySpec`` of every key for ``n`` survivors, ranks 0..n-1) from live replicas and
        the snapshot. Returns what it did and how long each part took; the state is the snapshot's step's
        (``resume_step``)."""
        import time

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

    def inject(self, plan: FaultPlan) -> None:
        """Arm ``plan``'s faults on their workers (tests and benchmarks); nothing else ever arms them."""
        self._all([w.arm_faults.remote(plan.actions_of(r)) for r, w in enumerate(self.workers) if plan.actions_of(r)],
                  "arm_faults")

    def _get(self, refs: list[ObjectRef]) -> list:
        return self.failover.get(self.workers, refs, self.timeout_s + GRACE_S)

    def _all(self, refs: list[ObjectRef], what: str) -> list:
        """Every answer of a call to the workers, within the runtime's deadline (``waits.get_within``)."""
        return get_within(refs, self.timeout_s + GRACE_S, what)

    def lost_workers(self, timeout_s: float = 10.0) -> list[int]:
        return self.failover.lost_workers(self.workers, timeout_s)

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

    def release(self, key: str) -> None:
        self._all([w.release.remote(key) for w in self.workers], f"release {key}")
        self.specs.pop(key, None)

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []
        if self._store is not None:
            ray.kill(self._store)
            self._store = None
