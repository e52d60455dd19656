"""The rollout-engine seam: what every engine the runtime runs implements (``Engine``), what opening one
takes (``EngineConfig``) and answers (``EngineOpened``).

A worker holds one engine per generation key (``Worker.engines``), whatever the engine: the runtime's own
(``engines.native``: every rank of a replica takes part, generating from the worker's shard) or one in a
process of its own (``engines.vllm``: the replica's TP rank 0 owns it, the other ranks hand it their
shards). ``registry.ENGINES`` maps ``run.rollout.engine`` to the implementation; what an engine can do is
declared as plain data in ``spec.engines`` (``EngineTraits``), which the driver, the cost model and the
policy read: nothing outside an implementation asks which engine it is.

Every method takes the worker's shard of the key (``sm``) where it needs one and answers on every rank;
the worker keeps the answer of each replica's output rank. An engine without a session open, or one that
owns nothing on this rank, answers None.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from nereus.elastic.kvplan import GenPlacement, MigrationPlan
from nereus.runtime.comm.faults import FaultHook
from nereus.runtime.comm.transfer import TransferComm
from nereus.runtime.engines.answers import ClosedReplica, MigrationOutcome, ReplicaRollout
from nereus.runtime.engines.sampling import SamplingParams
from nereus.runtime.model.decoder import ModelConfig
from nereus.runtime.parallel.sharded import ShardedModel
from nereus.spec.generation import ReplicaStatus
from nereus.spec.levers import Speculation
from nereus.spec.rollout import RolloutEngine

if TYPE_CHECKING:
    from nereus.runtime.engines.pool import IdleEngines


@dataclass(frozen=True)
class EngineConfig:
    """What one replica's engine is opened with: the model, the longest sequence it must hold, the
    sequences it schedules at a time, its dtype, the job's engine (``settings.engine``) and its keys, and
    the generation layout's TP size."""

    cfg: ModelConfig
    max_model_len: int
    max_num_seqs: int = 256  # ``EngineTraits.slots``: run.rollout.slots, else the engine's default
    dtype: str = "float32"
    seed: int = 0
    settings: RolloutEngine = RolloutEngine()
    tp: int = 1  # the generation layout's TP (vLLM's tensor_parallel_size)


class EngineOpened(Enum):
    """What a worker's ``engine_open`` did."""

    NONE = "none"  # no engine here: the key is not on this worker, or this is a TP rank > 0 of its replica
    STARTED = "started"
    REUSED = "reused"  # an idle engine of the same configuration took the weights


@dataclass(frozen=True)
class EnginesOpened:
    """The engines a ``Runtime.open_engine`` call started and reused."""

    started: int
    reused: int

    @staticmethod
    def of(answers: list[EngineOpened]) -> EnginesOpened:
        return EnginesOpened(answers.count(EngineOpened.STARTED), answers.count(EngineOpened.REUSED))


@dataclass(frozen=True)
class MigrationContext:
    """A worker's part of a mid-step move besides its engine: where the key's replicas run (every worker
    of the world holds the key's groups, member or not), its global rank, the world's transfer and control
    groups, and the fault hook."""

    where: GenPlacement
    rank: int
    comm: TransferComm
    faults: FaultHook


class Engine(Protocol):
    """One generation key's rollout engine on one worker."""

    # it runs outside the runtime's torch.distributed world: kept when a worker re-forms its world
    outlives_world: ClassVar[bool]
    # the deadline of an open, seconds (0: the runtime's call timeout)
    start_s: ClassVar[float]

    @classmethod
    def open(cls, sm: ShardedModel | None, config: EngineConfig, idle: IdleEngines) -> tuple[Engine, EngineOpened]:
        """This worker's part of the key's engine on its replica's layout, loaded with the replica's weights
        (an idle engine of ``config`` from ``idle`` where one fits); ``sm``: this worker's shard of the key,
        None outside its layout (a bystander of the same kind, for world-wide calls)."""
        ...

    @classmethod
    def bystander(cls) -> Engine:
        """An engine of this kind that holds nothing here (a worker outside the key's layout)."""
        ...

    def refresh(self, sm: ShardedModel) -> float | None:
        """The shard's current weights into the engine after a weight sync; seconds, or None when the engine
        reads the shard itself."""
        ...

    def generate(self, sm: ShardedModel, prompts: list[list[int]], params: SamplingParams,
                 faults: FaultHook) -> ReplicaRollout | None:
        """The replica's rows of ``prompts`` (``sm.replica_rows``) in one call: tokens and log-probs per row,
        kept, carried or deferred by the round in ``params`` (tail batching, partial rollout), with the
        speculation ``params.speculation`` carries where the engine takes it per call."""
        ...

    def session_open(self, sm: ShardedModel, prompts: list[list[int]], params: SamplingParams) -> bool | None:
        """A generation that lives across calls on the replica's rows (mid-step decision points)."""
        ...

    def session_run(self, sm: ShardedModel, iterations: int) -> ReplicaStatus | None:
        """Up to ``iterations`` iterations of the session; the replica's status."""
        ...

    def speculate(self, sm: ShardedModel, speculation: Speculation | None) -> tuple[int, int] | None:
        """The session's speculation switched for its next iterations; (draft, accepted) tokens so far.
        Raises ``ValueError`` where the engine fixed its speculation when it started."""
        ...

    def migrate(self, plan: MigrationPlan, ctx: MigrationContext) -> MigrationOutcome:
        """This worker's part of moving unfinished rows between the key's replicas (every worker of the world
        takes part: the commit vote is world-wide); ``ok=False`` when it did not commit."""
        ...

    def session_close(self, sm: ShardedModel) -> ClosedReplica | None:
        """The session run to its end and dropped; every row the replica finished."""
        ...

    def tensors(self) -> dict[str, torch.Tensor] | None:
        """The engine's parameters in its own layout (tests); None where it keeps none of its own."""
        ...

    def close(self, idle: IdleEngines) -> None:
        """Closed by its key (a move, a recovery, a release): a running engine parked in ``idle``."""
        ...
