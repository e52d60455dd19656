"""The Ray actor of one device (``Worker``): holds the shards of every loaded model-stage by key, and
answers the runtime's typed calls on them; ``workers.Runtime`` drives a world of them.

Each operation on a key runs on every worker of the key's layout at once (collectives need all of
them); workers outside it answer None, and of a layout's workers only each data-parallel replica's output
rank (last pipeline stage, TP rank 0) returns a result, as ``calls.ReplicaOutput(dp, value)``.

``Worker`` composes one mixin per role (``worker_roles``: training, inference, transitions, recovery, over
the shared state of ``worker_roles.core.WorkerCore``) with the generation part, which is still written
out here: the generation engines that live across calls, the rollout engines and their idle pool.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import ray
import torch

from nereus.elastic.kvplan import MigrationPlan
from nereus.runtime.cluster.calls import ReplicaOutput
from nereus.runtime.cluster.worker_roles.core import WorkerCore, WorldAborted
from nereus.runtime.cluster.worker_roles.inference import InferenceRole
from nereus.runtime.cluster.worker_roles.recovery import RecoveryRole
from nereus.runtime.cluster.worker_roles.training import TrainingRole
from nereus.runtime.cluster.worker_roles.transitions import TransitionRole
from nereus.runtime.engines.answers import ReplicaRollout
from nereus.runtime.engines.decode_engine import DecodeEngine
from nereus.runtime.engines.engine_pool import EngineOpened, IdleEngines
from nereus.runtime.engines.sampling import SamplingParams
from nereus.runtime.engines.session import ClosedReplica, MigrationOutcome
from nereus.runtime.engines.vllm_engine import EngineConfig, ReplicaEngine
from nereus.runtime.parallel.sharded import ShardedModel
from nereus.spec.generation import ReplicaStatus
from nereus.spec.rollout import Speculation

__all__ = ["Worker", "WorldAborted"]

T = TypeVar("T")


# Calls run one at a time, in order ("default" group); ``abort`` and ``pid`` answer from their own thread
# even while a call is blocked in a collective with a lost peer.
@ray.remote(concurrency_groups={"control": 1})
class Worker(TrainingRole, InferenceRole, TransitionRole, RecoveryRole, WorkerCore):
    """One device: holds the shards of every loaded model-stage, keyed by name. Its roles' methods come
    from the mixins; the generation part below holds the generation state, initialised here."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__(rank, world)
        self.engines: dict[str, DecodeEngine] = {}  # key -> its generation engine across calls (run.midstep)
        # key -> this replica's vLLM engine (run.rollout.engine); None on a TP rank > 0 of its replica
        self.rollout: dict[str, ReplicaEngine | None] = {}
        self.idle = IdleEngines()  # closed engines, kept running for the next open of the same config

    # ----- generation (the engines' part of the actor) -------------------------------------------------
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
