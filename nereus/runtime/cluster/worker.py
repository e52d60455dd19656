"""The Ray actor of one device (``Worker``): holds the shards of every loaded model-stage by key, and
answers the runtime's typed calls on them; ``workers.Runtime`` drives a world of them.

Each operation on a key runs on every worker of the key's layout at once (collectives need all of
them); workers outside it answer None, and of a layout's workers only each data-parallel replica's output
rank (last pipeline stage, TP rank 0) returns a result, as ``calls.ReplicaOutput(dp, value)``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

import ray
import torch
from ray import ObjectRef

from nereus.elastic.kvplan import MigrationPlan
from nereus.runtime.cluster.calls import ReplicaOutput
from nereus.runtime.comm.faults import FaultHook
from nereus.runtime.engines.answers import ReplicaRollout
from nereus.runtime.engines.decode_engine import DecodeEngine
from nereus.runtime.engines.engine_pool import EngineOpened, IdleEngines
from nereus.runtime.engines.sampling import SamplingParams
from nereus.runtime.engines.session import ClosedReplica, MigrationOutcome
from nereus.runtime.engines.vllm_engine import EngineConfig, ReplicaEngine
from nereus.runtime.model.decoder import ModelConfig
from nereus.runtime.model.memory import MemoryReport
from nereus.runtime.parallel.sharded import Batch, LossFn, ReplicaStats, ShardedModel
from nereus.spec.generation import ReplicaStatus
from nereus.spec.layout import Layout
from nereus.spec.rollout import Speculation

if TYPE_CHECKING:
    from nereus.elastic.plan import TransitionPlan
    from nereus.runtime.comm.groups import ParallelGroups
    from nereus.runtime.comm.transfer import TransferComm
    from nereus.runtime.parallel.shard_state import Shards
    from nereus.runtime.recovery.snapshots import StateImage
    from nereus.runtime.transitions.live import KeySpec, TransitionAnswer

T = TypeVar("T")


class WorldAborted(RuntimeError):
    """The driver aborted this worker's world (a peer was lost); the call in flight was abandoned."""


# Calls run one at a time, in order ("default" group); ``abort`` and ``pid`` answer from their own thread
# even while a call is blocked in a collective with a lost peer.
@ray.remote(concurrency_groups={"control": 1})
class Worker:
    """One device: holds the shards of every loaded model-stage, keyed by name."""

    def __init__(self, rank: int, world: int) -> None:
        torch.set_num_threads(1)
        self.rank, self.world = rank, world
        self.models: dict[str, ShardedModel] = {}
        self.groups: dict[str, ParallelGroups] = {}
        self.pending: dict[str, ParallelGroups] = {}  # a coming transition's groups (``prepare_groups``)
        self.comm: TransferComm | None = None  # the world's transfer groups (``init_comm``)
        self._abort = threading.Event()
        self._stuck: list[threading.Thread] = []  # calls abandoned by ``abort``, still blocked
        self.faults = FaultHook()  # does nothing unless a test's fault plan armed it
        self.engines: dict[str, DecodeEngine] = {}  # key -> its generation engine across calls (run.midstep)
        # key -> this replica's vLLM engine (run.rollout.engine); None on a TP rank > 0 of its replica
        self.rollout: dict[str, ReplicaEngine | None] = {}
        self.idle = IdleEngines()  # closed engines, kept running for the next open of the same config

    # ----- failure handling -----------------------------------------------------------------------
    @ray.method(concurrency_group="control")
    def pid(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="control")
    def abort(self) -> bool:
        """Give up the call in flight (blocked on a lost peer): it returns ``WorldAborted`` at once and
        the world is re-formed by ``reinit``."""
        self._abort.set()
        return True

    @ray.method(concurrency_group="control")
    def arm_faults(self, actions: dict[str, str]) -> bool:
        """Arm this worker's fault hook (``Runtime.inject``: tests and benchmarks only)."""
        self.faults.arm(actions)
        return True

    def _guarded(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on a helper thread, so that ``abort`` can release this worker from a collective
        that will never complete; a gloo collective cannot be interrupted, so the thread is abandoned (it
        fails once ``reinit`` destroys its world) and never touches state the recovery rebuilds."""
        if self._abort.is_set():
            raise WorldAborted("this worker's world was aborted; re-form it (Runtime.recover)")
        out: dict = {}
        done = threading.Event()

        def run() -> None:
            try:
                out["value"] = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
                out["error"] = exc
            finally:
                done.set()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        while not done.wait(0.05):
            if self._abort.is_set():
                self._stuck.append(t)
                raise WorldAborted("a peer was lost; the call in flight was abandoned")
        if "error" in out:
            raise out["error"]
        return out["value"]

    def address(self) -> tuple[str, int]:
        from nereus.runtime.cluster.launch import free_port

        return ray.util.get_node_ip_address(), free_port()

    def init_dist(self, master: str, port: int, timeout_s: float) -> str:
        import torch.distributed as dist

        from nereus.runtime.comm.groups import default_backend, local_device

        backend = default_backend()
        if backend == "nccl":
            torch.cuda.set_device(local_device())
        os.environ["LOCAL_RANK"] = "0"
        if master.startswith("store://"):  # several nodes: the head node's store (``nodes.RendezvousStore``)
            from nereus.runtime.hosts.nodes import open_store

            dist.init_process_group(backend, store=open_store(master, timeout_s), rank=self.rank,
                                    world_size=self.world, timeout=timedelta(seconds=timeout_s))
            return backend
        if master.startswith("file://"):  # one host: a file rendezvous, so no TCP store listens on any interface
            init = master
        else:
            os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(port))
            init = "env://"
        dist.init_process_group(backend, init_method=init, rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=timeout_s))
        return backend

    def load(self, key: str, cfg: ModelConfig, layout: Layout, ranks: list[int], checkpoint: str | None,
             state: dict | None, dtype: str, schedule: str) -> bool:
        from nereus.runtime.comm.groups import ParallelGroups
        from nereus.runtime.model.dtypes import torch_dtype
        from nereus.runtime.model.hf import load_boxes, slice_boxes
        from nereus.runtime.parallel.sharded import ShardedModel, shard_boxes, tied_head

        groups = ParallelGroups(layout, ranks, tied_embeddings=tied_head(cfg))
        self.groups[key] = groups
        if not groups.member:
            return False
        boxes = shard_boxes(cfg, groups)
        tensors = load_boxes(checkpoint, boxes) if checkpoint else slice_boxes(state, boxes)
        self.models[key] = ShardedModel(cfg, groups, tensors, torch_dtype(dtype), schedule)
        return True

    def reinit(self, master: str, port: int, world: int, timeout_s: float, rank: int | None = None) -> bool:
        """Leave the current world (every group with it) and join one of ``world`` workers as ``rank``
        (default: the same), keeping this worker's shards in memory; ``regroup`` then rebuilds them on the
        new world's groups. Calls abandoned by ``abort`` fail once their world is gone."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        for t in self._stuck:
            t.join(timeout=2.0)  # it fails once its world is destroyed; never wait long on it
        self._stuck = [t for t in self._stuck if t.is_alive()]
        self._abort.clear()
        self.world, self.groups, self.pending = world, {}, {}
        self.engines = {}
        self.rank = self.rank if rank is None else rank
        self.init_dist(master, port, timeout_s)
        return self.init_comm(min(timeout_s, 120.0))

    def state_image(self, key_model: dict[str, str], optimizer_for: list[str], weights_dp0_only: bool) -> StateImage:
        """A copy of this worker's state of the keys in ``key_model`` (``recovery.state_image``); as a
        return value it lives in Ray's object store, owned by the driver: a host-memory snapshot that
        outlives this process."""
        from nereus.runtime.recovery.snapshots import state_image

        return state_image(self.models, key_model, set(optimizer_for), weights_dp0_only)

    def state_images(self, models: list[str], keys: dict[str, dict[str, str]],
                     optimizer_for: list[str]) -> StateImage | tuple[StateImage, ...]:
        """``state_image`` of each of ``models`` (its keys in ``keys``), one return value each (a snapshot:
        data-parallel replica 0's weights, every rank's optimizer state)."""
        images = tuple(self.state_image(keys[m], optimizer_for, True) for m in models)
        return images if len(images) > 1 else images[0]

    def restore(self, specs: list[KeySpec], images: dict[str, list[ObjectRef]]) -> bool:
        """Replace every key by ``specs`` (groups from ``prepare_groups`` in the re-formed world), each
        buffer filled from ``images`` (model → object refs of state images, in preference order)."""
        from nereus.runtime.recovery.snapshots import restore_state

        pending, self.pending = self.pending, {}
        self.close_engines()  # their keys are rebuilt on a new layout: the driver opens engines anew
        fetched = {m: ray.get(refs) for m, refs in images.items()}
        models = restore_state(specs, pending, fetched, self.comm)
        self.models, self.groups = models, dict(pending)
        return True

    def regroup(self, specs: list[KeySpec]) -> bool:
        """Every key's groups in the new world (collective, same order everywhere), and its shard rebuilt
        around the same tensors: parameters adopted, Adam's segments and moments handed over."""
        from nereus.runtime.comm.groups import ParallelGroups
        from nereus.runtime.parallel.sharded import tied_head
        from nereus.runtime.transitions.live import rebuild

        for s in specs:
            g = ParallelGroups(s.layout, list(s.ranks), tied_embeddings=tied_head(s.cfg))
            self.groups[s.key] = g
            if s.key in self.models:
                self.models[s.key] = rebuild(self.models[s.key], g)
        return True

    def init_comm(self, timeout_s: float) -> bool:
        from nereus.runtime.comm.transfer import TransferComm

        self.comm = TransferComm(timeout_s)
        return True

    def prepare_groups(self, specs: list[KeySpec]) -> bool:
        """The process groups of every key of a coming transition, created ahead (collective: every
        worker, same order); a key whose layout and workers do not change keeps its groups."""
        from nereus.runtime.comm.groups import ParallelGroups
        from nereus.runtime.parallel.sharded import tied_head

        self.pending = {}
        for s in specs:
            cur = self.groups.get(s.key)
            if cur is not None and (cur.layout, tuple(cur.ranks)) == (s.layout, tuple(s.ranks)):
                self.pending[s.key] = cur
            else:
                self.pending[s.key] = ParallelGroups(s.layout, list(s.ranks), tied_embeddings=tied_head(s.cfg))
        return True

    def follows(self, source: str, keys: list[str]) -> bool:
        """Whether every shard this worker holds of ``keys`` is ``source``'s shard's memory here
        (``transitions.live.follows``): true also when it holds none of them."""
        from nereus.runtime.transitions.live import follows

        return all(follows(self.models[k], self.models.get(source)) for k in keys if k in self.models)

    def transition(self, graph: TransitionPlan, old_specs: list[KeySpec], new_specs: list[KeySpec],
                   sources: list[KeySpec] | None = None) -> TransitionAnswer:
        """Replace the keys of ``old_specs`` by ``new_specs``, state moved as ``graph`` plans (groups from
        ``prepare_groups``) from the keys of ``sources`` (default ``old_specs``; a weight sync reads the
        training key only). On failure every worker keeps its old shards and reports the error."""
        return self._guarded(self._transition, graph, old_specs, new_specs, sources)

    def _transition(self, graph: TransitionPlan, old_specs: list[KeySpec], new_specs: list[KeySpec],
                    sources: list[KeySpec] | None) -> TransitionAnswer:
        import time

        from nereus.runtime.transitions.live import TransitionAnswer, transition_keys

        t0 = time.perf_counter()
        sources = old_specs if sources is None else sources
        old = {s.key: self.models[s.key] for s in sources if s.key in self.models}
        pending, self.pending = self.pending, {}
        try:
            models, measured = transition_keys(graph, old, sources, new_specs, pending, self.comm, self.faults)
        except Exception as exc:  # noqa: BLE001 - reported to the driver; the old layout stays
            for key, g in pending.items():
                if g is not self.groups.get(key):
                    g.destroy()
            self.comm.renew()
            return TransitionAnswer(False, str(exc), time.perf_counter() - t0)
        keep = {id(g) for g in pending.values()}
        for s in old_specs:
            self.models.pop(s.key, None)
            g = self.groups.pop(s.key, None)
            if g is not None and id(g) not in keep:
                g.destroy()
        self.models.update(models)
        self.groups.update(pending)
        return TransitionAnswer(True, "", time.perf_counter() - t0, measured)

    # ----- typed operations on one key's shard (None on workers outside its layout) -------------------
    def _on(self, key: str, fn: Callable[..., T], *args: object) -> T | None:
        """``fn(shard, *args)`` on this worker's shard of ``key`` (guarded), or None without one."""
        sm = self.models.get(key)
        return None if sm is None else self._guarded(fn, sm, *args)

    @staticmethod
    def _output(sm: ShardedModel, out: T) -> ReplicaOutput[T] | None:
        """The result from each replica's output rank, whose result is complete; else None."""
        return ReplicaOutput(sm.groups.coords.dp, out) if sm.is_output_rank else None

    def logprobs(self, key: str, tokens: torch.Tensor) -> ReplicaOutput[torch.Tensor] | None:
        return self._on(key, lambda sm: self._output(sm, sm.logprobs(tokens)))

    def logprobs_and_entropy(self, key: str,
                             tokens: torch.Tensor) -> ReplicaOutput[tuple[torch.Tensor, torch.Tensor]] | None:
        return self._on(key, lambda sm: self._output(sm, sm.logprobs_and_entropy(tokens)))

    def values(self, key: str, tokens: torch.Tensor) -> ReplicaOutput[torch.Tensor] | None:
        return self._on(key, lambda sm: self._output(sm, sm.values(tokens)))

    def train_step(self, key: str, batch: Batch, loss_fn: LossFn, lr: float, max_grad_norm: float | None,
                   weight_decay: float = 0.0) -> ReplicaOutput[ReplicaStats] | None:
        """One optimizer step; the fault point ``train_step`` lies between the backward pass and Adam."""

        def run(sm: ShardedModel) -> ReplicaOutput[ReplicaStats] | None:
            metrics: list[dict[str, float]] = []
            losses = sm.backward(batch, loss_fn, metrics)
            self.faults.at("train_step")
            norm = sm.step(lr, max_grad_norm, weight_decay)
            return self._output(sm, ReplicaStats(tuple(losses), tuple(metrics), norm))

        return self._on(key, run)

    def generate(self, key: str, prompts: list[list[int]],
                 params: SamplingParams) -> ReplicaOutput[list[list[int]]] | None:
        from nereus.runtime.engines.fixed_batch import generate

        return self._on(key, lambda sm: self._output(sm, generate(sm, prompts, params)))

    def generate_with_logprobs(self, key: str, prompts: list[list[int]], params: SamplingParams,
                               ) -> ReplicaOutput[ReplicaRollout] | None:
        """New tokens and their log-probs per prompt of the replica's rows (kept, carried or deferred by the
        tail levers), by the key's vLLM engine where one is open."""
        from nereus.runtime.engines.fixed_batch import generate_with_logprobs

        if key in self.rollout:
            return self._on_engine(key, lambda engine, sm: ReplicaRollout(
                engine.generate(prompts, sm.replica_rows(len(prompts)), params, self.faults)))
        return self._on(key, lambda sm: self._output(sm, generate_with_logprobs(sm, prompts, params)))

    # ----- a vLLM engine per generation replica (run.rollout.engine: vllm; runtime.engines.vllm_engine) ----
    def _on_engine(self, key: str, fn: Callable[[ReplicaEngine, ShardedModel], T]) -> ReplicaOutput[T] | None:
        """``fn(engine, shard)`` on the replica's TP rank 0, which owns its vLLM engine and is its output
        rank, as the replica's output; None on the replica's other TP ranks (they hold no engine)."""
        engine = self.rollout[key]
        return self._on(key, lambda sm: None if engine is None else self._output(sm, fn(engine, sm)))

    def engine_open(self, key: str, config: EngineConfig) -> EngineOpened:
        """This replica's engine for ``key`` loaded with the key's weights (replacing one open): on the
        replica's TP rank 0, an idle engine of ``config`` if this worker has one, else a new one; its other
        TP ranks hand it their shards (``replica_weights``) and hold none."""
        from nereus.runtime.parallel.shard_state import replica_weights

        self.close_engines([key])
        sm = self.models.get(key)
        if sm is None:
            return EngineOpened.NONE
        weights = self._guarded(replica_weights, sm)
        if weights is None:
            self.rollout[key] = None
            return EngineOpened.NONE
        engine, reused = self._guarded(self.idle.open, config, weights)
        self.rollout[key] = engine
        return EngineOpened.REUSED if reused else EngineOpened.STARTED

    def engine_update(self, key: str) -> float | None:
        """The key's current weights into its engine, in place (the per-step sync); the engine's seconds
        (None on the TP ranks that only hand their shards over)."""
        from nereus.runtime.parallel.shard_state import replica_weights

        sm = self.models.get(key)
        if key not in self.rollout or sm is None:
            return None
        weights, engine = self._guarded(replica_weights, sm), self.rollout[key]
        return None if engine is None else self._guarded(engine.load_weights, weights)

    def engine_tensors(self, key: str) -> dict[str, torch.Tensor] | None:
        """The engine's parameters in its own (fused) layout (tests)."""
        engine = self.rollout.get(key)
        return None if engine is None else self._guarded(engine.tensors)

    def close_engines(self, keys: list[str] | None = None) -> None:
        """The keys' engines (every key's by default) closed to this worker's idle ones (``engine_pool``)."""
        for key in list(self.rollout) if keys is None else keys:
            engine = self.rollout.pop(key, None)
            if engine is not None:
                self.idle.park(engine)

    # ----- a generation engine that lives across calls (``gen_session``: mid-step moves) -------------
    def gen_open(self, key: str, prompts: list[list[int]], params: SamplingParams) -> ReplicaOutput[bool] | None:
        """A fresh continuous-batching engine on this replica's rows of ``prompts`` (``params.slots``), or a
        session of the key's vLLM engine (``vllm_session``) where one is open."""
        from nereus.runtime.engines.decode_engine import replica_engine

        if key in self.rollout:
            return self._on_engine(key, lambda engine, sm: engine.session_open(
                prompts, sm.replica_rows(len(prompts)), params, sm.groups.coords.dp))

        def run(sm: ShardedModel) -> ReplicaOutput[bool] | None:
            self.engines[key] = replica_engine(sm, prompts, params, params.slots)
            return self._output(sm, True)

        return self._on(key, run)

    def gen_run(self, key: str, iterations: int) -> ReplicaOutput[ReplicaStatus] | None:
        """Up to ``iterations`` iterations of ``key``'s engine; its status from output ranks."""
        from nereus.runtime.engines.session import run_chunk

        if key in self.rollout:
            return self._on_engine(key, lambda engine, sm: engine.session_run(iterations))
        return self._on(key, lambda sm: self._output(sm, run_chunk(self.engines[key], iterations,
                                                                   sm.groups.coords.dp)))

    def gen_speculate(self, key: str, speculation: Speculation | None) -> ReplicaOutput[tuple[int, int]] | None:
        """Switch ``key``'s engine's n-gram speculation (a ``spec.rollout.Speculation``, or None: off) for its
        next iterations; (DP replica, (draft tokens, accepted tokens) so far) from output ranks."""

        def run(sm: ShardedModel) -> ReplicaOutput[tuple[int, int]] | None:
            engine = self.engines[key]
            engine.speculation = speculation
            return self._output(sm, (engine.draft_tokens, engine.accepted_tokens))

        return self._on(key, run)

    def gen_migrate(self, key: str, plan: MigrationPlan, vllm: bool = False) -> MigrationOutcome:
        """This worker's part of moving unfinished sequences between ``key``'s replicas (every worker of
        the world calls it: the commit vote is world-wide); ``ok=False`` when it did not commit. ``vllm``:
        between the key's vLLM engines (abort and re-prefill, ``vllm_session.migrate_requests``)."""
        from nereus.runtime.engines.session import migrate_sequences

        if vllm:
            from nereus.elastic.kvplan import GenPlacement
            from nereus.runtime.engines.vllm_session import migrate_requests

            groups = self.groups[key]  # every worker of the world holds the key's groups, member or not
            where = GenPlacement(groups.layout, tuple(groups.ranks))
            return self._guarded(migrate_requests, self.rollout.get(key), plan, where, self.rank, self.comm,
                                 self.faults)
        return self._guarded(migrate_sequences, self.engines.get(key), plan, self.comm, self.faults)

    def gen_close(self, key: str) -> ReplicaOutput[ClosedReplica] | None:
        """Run ``key``'s engine to the end and drop it; every sequence it finished, from output ranks."""
        from nereus.runtime.engines.session import close_engine

        if key in self.rollout:
            return self._on_engine(key, lambda engine, sm: engine.session_close())
        engine = self.engines.pop(key, None)
        if engine is None:
            return None
        return self._on(key, lambda sm: self._output(sm, close_engine(engine, sm.groups.coords.dp)))

    def memory(self, key: str) -> MemoryReport | None:
        sm = self.models.get(key)
        return sm.last_report if sm is not None else None

    def shard_shapes(self, key: str) -> dict[str, tuple[int, ...]] | None:
        sm = self.models.get(key)
        return None if sm is None else {name: tuple(p.shape) for name, p in sm.shards().items()}

    def read_shards(self, key: str) -> Shards | None:
        """name → (global box, tensor) of DP replica 0's shard (``shard_state.read_shards``)."""
        from nereus.runtime.parallel.shard_state import read_shards

        return self._on(key, read_shards)

    def read_optimizer(self, key: str) -> dict[str, torch.Tensor] | None:
        from nereus.runtime.parallel.shard_state import read_optimizer

        return self._on(key, read_optimizer)

    def write_optimizer(self, key: str, state: dict[str, torch.Tensor], lr: float) -> bool:
        from nereus.runtime.parallel.shard_state import write_optimizer

        self._on(key, write_optimizer, state, lr)
        return key in self.models

    def holdings(self, key: str, model: str) -> StateImage:
        """A state image (``recovery.state_image``) of ``key``: weights and Adam state by global box."""
        return self.state_image({key: model}, [model], False)

    def release(self, key: str) -> None:
        self.models.pop(key, None)
        self.engines.pop(key, None)
        self.close_engines([key])
        groups = self.groups.pop(key, None)
        if groups is not None:
            groups.destroy()
