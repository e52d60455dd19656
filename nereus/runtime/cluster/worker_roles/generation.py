"""The ``Worker``'s generation role: one rollout engine per key, whatever the engine
(``engines.protocol.Engine``, chosen by ``engines.registry`` from ``run.rollout.engine``), the idle pool of
engines that run in processes of their own, and the generation sessions that live across calls (mid-step
decision points and moves)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from nereus.elastic.kvplan import GenPlacement, MigrationPlan
from nereus.runtime.cluster.calls import ReplicaOutput
from nereus.runtime.cluster.worker_roles.core import WorkerCore
from nereus.runtime.engines.answers import ClosedReplica, MigrationOutcome, ReplicaRollout
from nereus.runtime.engines.pool import IdleEngines
from nereus.runtime.engines.protocol import Engine, EngineConfig, EngineOpened, MigrationContext
from nereus.runtime.engines.registry import default_engine, engine_class
from nereus.runtime.engines.sampling import SamplingParams
from nereus.runtime.parallel.sharded import ShardedModel
from nereus.spec.generation import ReplicaStatus
from nereus.spec.levers import Speculation

T = TypeVar("T")


class GenerationRole(WorkerCore):
    """Generation on a key's engine (requests ``calls.Generate``, ``GenerateWithLogprobs``, ``GenOpen``,
    ``GenRun``, ``GenSpeculate``, ``GenMigrate``, ``GenClose``) and the engines' lifecycle (``engine_open``,
    ``engine_update``, ``close_engines``). Its state: ``engines`` (key -> engine) and ``idle`` (closed
    engines of their own processes); it reads ``models``, ``groups``, ``comm`` and ``faults``."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__(rank, world)
        # key -> its rollout engine on this worker, whatever the engine (``engines.protocol.Engine``): the one
        # ``engine_open`` opened, else the default engine's, which generates from the key's shard
        self.engines: dict[str, Engine] = {}
        self.idle = IdleEngines()  # closed engines of their own processes, kept for the next open of their config

    def _engine(self, key: str) -> Engine:
        """``key``'s engine on this worker (``engines.registry.default_engine`` until one is opened)."""
        if key not in self.engines:
            self.engines[key] = default_engine()
        return self.engines[key]

    def _answer(self, key: str, fn: Callable[[Engine, ShardedModel], T | None]) -> ReplicaOutput[T] | None:
        """``fn(engine, shard)`` on this worker's shard of ``key`` (guarded), as its replica's output from the
        output rank; None elsewhere, and where the engine answers None (it owns nothing on this rank)."""
        engine = self._engine(key)

        def run(sm: ShardedModel) -> ReplicaOutput[T] | None:
            out = fn(engine, sm)
            return None if out is None else self._output(sm, out)

        return self._on(key, run)

    def generate(self, key: str, prompts: list[list[int]],
                 params: SamplingParams) -> ReplicaOutput[list[list[int]]] | None:
        """Greedy or sampled tokens of the runtime's own fixed batch, whatever the key's rollout engine (the
        held-out evaluation, the reference)."""
        from nereus.runtime.engines.native.fixed_batch import generate

        return self._on(key, lambda sm: self._output(sm, generate(sm, prompts, params)))

    def generate_with_logprobs(self, key: str, prompts: list[list[int]], params: SamplingParams,
                               ) -> ReplicaOutput[ReplicaRollout] | None:
        """New tokens and their log-probs per prompt of the replica's rows (kept, carried or deferred by the
        tail levers), by the key's engine."""
        return self._answer(key, lambda engine, sm: engine.generate(sm, prompts, params, self.faults))

    def engine_open(self, key: str, config: EngineConfig) -> EngineOpened:
        """``key``'s engine of ``config.settings.engine`` on this worker, loaded with the key's weights
        (replacing one open; ``Engine.open``); a bystander of the same kind on a worker outside the key's
        layout, which takes part in the engine's world-wide calls."""
        self.close_engines([key])
        opened = engine_class(config.settings.engine).open
        engine, answer = self._guarded(opened, self.models.get(key), config, self.idle)
        self.engines[key] = engine
        return answer

    def engine_update(self, key: str) -> float | None:
        """The key's current weights into its engine, in place (the per-step sync); the engine's seconds
        (None where the engine reads the shard itself, or on ranks that only hand their shards over)."""
        sm, engine = self.models.get(key), self.engines.get(key)
        return None if sm is None or engine is None else self._guarded(engine.refresh, sm)

    def engine_tensors(self, key: str) -> dict[str, torch.Tensor] | None:
        """The engine's parameters in its own (fused) layout (tests)."""
        engine = self.engines.get(key)
        return None if engine is None else self._guarded(engine.tensors)

    def close_engines(self, keys: list[str] | None = None) -> None:
        """The keys' engines (every key's by default) closed: one in a process of its own parked among this
        worker's idle ones (``engines.pool``)."""
        for key in list(self.engines) if keys is None else keys:
            engine = self.engines.pop(key, None)
            if engine is not None:
                engine.close(self.idle)

    def drop_world_engines(self) -> None:
        """This worker left its world: the engines that ran in it (their sessions on its groups) are dropped,
        those in processes of their own stay (``Engine.outlives_world``)."""
        self.engines = {key: e for key, e in self.engines.items() if e.outlives_world}

    # ----- a generation that lives across calls (mid-step decision points and moves) ------------------
    def gen_open(self, key: str, prompts: list[list[int]], params: SamplingParams) -> ReplicaOutput[bool] | None:
        """A generation session of ``key``'s engine on this replica's rows of ``prompts``."""
        return self._answer(key, lambda engine, sm: engine.session_open(sm, prompts, params))

    def gen_run(self, key: str, iterations: int) -> ReplicaOutput[ReplicaStatus] | None:
        """Up to ``iterations`` iterations of ``key``'s session; its status from output ranks."""
        return self._answer(key, lambda engine, sm: engine.session_run(sm, iterations))

    def gen_speculate(self, key: str, speculation: Speculation | None) -> ReplicaOutput[tuple[int, int]] | None:
        """Switch ``key``'s session's speculation (None: off) for its next iterations; (draft tokens, accepted
        tokens) so far from output ranks."""
        return self._answer(key, lambda engine, sm: engine.speculate(sm, speculation))

    def gen_migrate(self, key: str, plan: MigrationPlan) -> MigrationOutcome:
        """This worker's part of moving unfinished sequences between ``key``'s replicas (every worker of
        the world calls it: the commit vote is world-wide); ``ok=False`` when it did not commit. Each engine
        moves its own way (``Engine.migrate``: KV caches or re-prefill)."""
        groups = self.groups[key]  # every worker of the world holds the key's groups, member or not
        ctx = MigrationContext(GenPlacement(groups.layout, tuple(groups.ranks)), self.rank, self.comm, self.faults)
        return self._guarded(self._engine(key).migrate, plan, ctx)

    def gen_close(self, key: str) -> ReplicaOutput[ClosedReplica] | None:
        """Run ``key``'s session to the end and drop it; every sequence it finished, from output ranks."""
        if key not in self.engines:
            return None
        return self._answer(key, lambda engine, sm: engine.session_close(sm))
