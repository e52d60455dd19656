"""The runtime's own rollout engine (``run.rollout.engine: native``) behind the ``Engine`` seam.

It generates from the worker's shard of the key: every rank of a replica takes part (TP collectives,
pipeline stages), so there is nothing to open, reload after a weight sync or restart after a move. One call
is the fixed batch (``fixed_batch``; the continuous-batching engine with ``params.slots``); a generation with
decision points is a session (``session``: one ``DecodeEngine`` per replica, kept here between calls), whose
moves send records, sampling streams and KV caches (``kv_migrate``) and whose speculation switches by live
batch (``speculative``). A plain fixed batch on one stage decodes from static buffers, as a captured CUDA
graph on a GPU (``graphed_decode``; ``run.rollout.native_decode``). It is the exact single-process reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from nereus.elastic.kvplan import MigrationPlan
from nereus.runtime.comm.faults import FaultHook
from nereus.runtime.engines.answers import ClosedReplica, MigrationOutcome, ReplicaRollout
from nereus.runtime.engines.native.decode_engine import DecodeEngine, replica_engine
from nereus.runtime.engines.native.fixed_batch import generate_with_logprobs
from nereus.runtime.engines.native.graphed_decode import decode_path, static_generate
from nereus.runtime.engines.native.session import close_engine, migrate_sequences, run_chunk
from nereus.runtime.engines.protocol import EngineConfig, EngineOpened, MigrationContext
from nereus.runtime.engines.sampling import SamplingParams
from nereus.runtime.parallel.sharded import ShardedModel
from nereus.spec.generation import ReplicaStatus
from nereus.spec.levers import Speculation

if TYPE_CHECKING:
    from nereus.runtime.engines.pool import IdleEngines


class NativeEngine:
    """A key's native engine on one worker: its step's session (a ``DecodeEngine``), when one is open, and
    how it decodes a fixed batch (``decode``: ``run.rollout.native_decode``)."""

    outlives_world: ClassVar[bool] = False  # its session runs on the world's groups
    start_s: ClassVar[float] = 0.0

    def __init__(self, decode: str = "auto") -> None:
        self.session: DecodeEngine | None = None
        self.decode = decode

    @classmethod
    def open(cls, sm: ShardedModel | None, config: EngineConfig,
             idle: IdleEngines) -> tuple[NativeEngine, EngineOpened]:
        return cls(config.settings.native_decode), EngineOpened.NONE  # the worker's shard is the engine

    @classmethod
    def bystander(cls) -> NativeEngine:
        return cls()

    def refresh(self, sm: ShardedModel) -> float | None:
        return None  # it reads the shard the sync wrote

    def generate(self, sm: ShardedModel, prompts: list[list[int]], params: SamplingParams,
                 faults: FaultHook) -> ReplicaRollout | None:
        path = decode_path(self.decode, sm, params)
        if path == "loop":
            return generate_with_logprobs(sm, prompts, params, faults)
        return static_generate(sm, prompts, params, capture=path == "graphed", faults=faults)

    def session_open(self, sm: ShardedModel, prompts: list[list[int]], params: SamplingParams) -> bool:
        """A fresh continuous-batching engine on this replica's rows of ``prompts`` (``params.slots``)."""
        self.session = replica_engine(sm, prompts, params, params.slots)
        return True

    def session_run(self, sm: ShardedModel, iterations: int) -> ReplicaStatus:
        return run_chunk(self.session, iterations, sm.groups.coords.dp_rank)

    def speculate(self, sm: ShardedModel, speculation: Speculation | None) -> tuple[int, int]:
        self.session.speculation = speculation
        return self.session.draft_tokens, self.session.accepted_tokens

    def migrate(self, plan: MigrationPlan, ctx: MigrationContext) -> MigrationOutcome:
        return migrate_sequences(self.session, plan, ctx.comm, ctx.faults)

    def session_close(self, sm: ShardedModel) -> ClosedReplica | None:
        session, self.session = self.session, None
        return None if session is None else close_engine(session, sm.groups.coords.dp_rank)

    def tensors(self) -> dict[str, torch.Tensor] | None:
        return None  # its parameters are the worker's shard

    def close(self, idle: IdleEngines) -> None:
        self.session = None
