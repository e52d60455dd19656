"""vLLM as a rollout engine (``run.rollout.engine: vllm``) behind the ``Engine`` seam.

One engine per data-parallel replica of the generation layout, in a process of its own (``server``: vLLM
takes over ``torch.distributed`` of the process it runs in), owned by the replica's TP rank 0; the
replica's other ranks only hand it their shards when it opens and after every weight sync
(``shard_state.replica_weights``). Every other worker of the world holds a bystander, which takes part in
the world-wide exchange and vote of a mid-step move (``session.migrate_requests``: an abort and a
re-prefill). Its speculation is fixed when it starts (``server.speculative_config``), and a worker's closed
engines stay running in its idle pool for the next open of the same configuration (``engines.pool``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from nereus.elastic.kvplan import MigrationPlan
from nereus.runtime.comm.faults import FaultHook
from nereus.runtime.engines.answers import ClosedReplica, MigrationOutcome, ReplicaRollout
from nereus.runtime.engines.protocol import EngineConfig, EngineOpened, MigrationContext
from nereus.runtime.engines.sampling import SamplingParams
from nereus.runtime.engines.vllm.server import ENGINE_START_S, ReplicaEngine
from nereus.runtime.engines.vllm.session import migrate_requests
from nereus.runtime.parallel.shard_state import replica_weights
from nereus.runtime.parallel.sharded import ShardedModel
from nereus.spec.generation import ReplicaStatus
from nereus.spec.levers import Speculation

if TYPE_CHECKING:
    from nereus.runtime.engines.pool import IdleEngines


class VllmEngine:
    """A key's vLLM engine on one worker: the replica's ``ReplicaEngine`` on its TP rank 0, None on every
    other worker (they answer None; the replica's output rank is its TP rank 0)."""

    outlives_world: ClassVar[bool] = True  # its own process, outside the runtime's world
    start_s: ClassVar[float] = ENGINE_START_S  # importing vLLM alone takes 10-30 s here

    def __init__(self, replica: ReplicaEngine | None = None) -> None:
        self.replica = replica

    @classmethod
    def open(cls, sm: ShardedModel | None, config: EngineConfig, idle: IdleEngines) -> tuple[VllmEngine, EngineOpened]:
        """On the replica's TP rank 0 an idle engine of ``config`` if this worker has one, else a new one,
        loaded with the replica's whole tensors; its other TP ranks hand it their shards and hold none."""
        if sm is None:
            return cls(), EngineOpened.NONE
        weights = replica_weights(sm)  # collective over the replica's TP group: whole tensors on its rank 0
        if weights is None:
            return cls(), EngineOpened.NONE
        replica, reused = idle.open(config, weights, ReplicaEngine)
        return cls(replica), EngineOpened.REUSED if reused else EngineOpened.STARTED

    @classmethod
    def bystander(cls) -> VllmEngine:
        return cls()

    def refresh(self, sm: ShardedModel) -> float | None:
        """The replica's new weights reloaded in place (``LocalVllm.load_weights``); the engine's seconds."""
        weights = replica_weights(sm)  # every TP rank of the replica hands its shard over
        return None if self.replica is None else self.replica.load_weights(weights)

    def generate(self, sm: ShardedModel, prompts: list[list[int]], params: SamplingParams,
                 faults: FaultHook) -> ReplicaRollout | None:
        """The replica's rows; the engine's own speculation (``params.speculation`` is not this engine's)."""
        if self.replica is None:
            return None
        return ReplicaRollout(self.replica.generate(prompts, sm.replica_rows(len(prompts)), params, faults))

    def session_open(self, sm: ShardedModel, prompts: list[list[int]], params: SamplingParams) -> bool | None:
        if self.replica is None:
            return None
        return self.replica.session_open(prompts, sm.replica_rows(len(prompts)), params, sm.groups.coords.dp_rank)

    def session_run(self, sm: ShardedModel, iterations: int) -> ReplicaStatus | None:
        return None if self.replica is None else self.replica.session_run(iterations)

    def speculate(self, sm: ShardedModel, speculation: Speculation | None) -> tuple[int, int] | None:
        raise ValueError("vLLM's speculation is fixed when its engine starts (speculative_config)")

    def migrate(self, plan: MigrationPlan, ctx: MigrationContext) -> MigrationOutcome:
        return migrate_requests(self.replica, plan, ctx.where, ctx.rank, ctx.comm, ctx.faults)

    def session_close(self, sm: ShardedModel) -> ClosedReplica | None:
        return None if self.replica is None else self.replica.session_close()

    def tensors(self) -> dict[str, torch.Tensor] | None:
        return None if self.replica is None else self.replica.tensors()

    def close(self, idle: IdleEngines) -> None:
        """The running engine parked in the worker's idle pool (its next open of the same config reuses it)."""
        if self.replica is not None:
            idle.park(self.replica)
            self.replica = None
