"""The driver's calls to the workers as typed requests, and the typed answer of a key's output ranks.

A request is a frozen dataclass naming one ``Worker`` method and holding its arguments; ``issue`` calls
that method, by name in the source, on one worker's actor handle and returns the Ray future. The runtime
issues a ``KeyCall`` on every worker of a key's layout (``Runtime.submit``) and a ``WorldCall`` on every
worker of the world (``Runtime.submit_all``); nothing selects a method by a computed name. A request that
changes its model's state says so in ``changes_state`` (the runtime's snapshots then no longer hold it).

Of a key's workers only each data-parallel replica's output rank (last pipeline stage, TP rank 0)
answers with a result, as ``ReplicaOutput(dp, value)``; the others answer None. ``by_replica`` orders
the values by replica.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Generic, Protocol, TypeVar

import torch

from nereus.elastic.kvplan import MigrationPlan
from nereus.runtime.engines.sampling import SamplingParams
from nereus.runtime.parallel.batch import TrainBatch
from nereus.runtime.parallel.sharded import LossFn
from nereus.spec.levers import Speculation

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

T = TypeVar("T")


@dataclass(frozen=True)
class ReplicaOutput(Generic[T]):
    """A data-parallel replica's result of one call, from its output rank (complete there)."""

    dp: int
    value: T


def by_replica(answers: Iterable[ReplicaOutput[T] | None]) -> list[T]:
    """The output ranks' values (None from every other worker) in data-parallel order."""
    return [a.value for a in sorted((a for a in answers if a is not None), key=lambda a: a.dp)]


class KeyCall(Protocol):
    """An operation on one key's shard, issued on every worker of the key's layout at once."""

    changes_state: ClassVar[bool]

    def issue(self, worker: ActorHandle, key: str) -> ObjectRef: ...


class WorldCall(Protocol):
    """An operation every worker of the world takes part in (a world-wide collective)."""

    def issue(self, worker: ActorHandle) -> ObjectRef: ...


@dataclass(frozen=True)
class Logprobs:
    """Next-token log-probs [B, T−1] of ``tokens`` (``Worker.logprobs``)."""

    tokens: torch.Tensor
    lengths: torch.Tensor | None = None  # [B]: each row's real tokens (a packing layout runs only those)
    changes_state: ClassVar[bool] = False

    def issue(self, worker: ActorHandle, key: str) -> ObjectRef:
        return worker.logprobs.remote(key, self.tokens, self.lengths)


@dataclass(frozen=True)
class LogprobsAndEntropy:
    """Log-probs and full-vocabulary entropies [B, T−1] from one pass (``Worker.logprobs_and_entropy``)."""

    tokens: torch.Tensor
    lengths: torch.Tensor | None = None  # [B]: each row's real tokens (a packing layout runs only those)
    routes: torch.Tensor | None = None  # [B, T, sparse layers, k]: experts to replay (router replay), or None
    changes_state: ClassVar[bool] = False

    def issue(self, worker: ActorHandle, key: str) -> ObjectRef:
        return worker.logprobs_and_entropy.remote(key, self.tokens, self.lengths, self.routes)


@dataclass(frozen=True)
class LogprobsEntropyAndSumPiSquared:
    """Log-probs, entropies and Σ_v π(v)² [B, T−1] from one pass (``Worker.logprobs_entropy_and_sum_pi_squared``;
    the optimal token baseline reads Σπ²)."""

    tokens: torch.Tensor
    lengths: torch.Tensor | None = None  # [B]: each row's real tokens (a packing layout runs only those)
    routes: torch.Tensor | None = None  # [B, T, sparse layers, k]: experts to replay (router replay), or None
    changes_state: ClassVar[bool] = False

    def issue(self, worker: ActorHandle, key: str) -> ObjectRef:
        return worker.logprobs_entropy_and_sum_pi_squared.remote(key, self.tokens, self.lengths, self.routes)


@dataclass(frozen=True)
class Values:
    """A value-head model's values [B, T] of ``tokens`` (``Worker.values``)."""

    tokens: torch.Tensor
    lengths: torch.Tensor | None = None  # [B]: each row's real tokens (a packing layout runs only those)
    changes_state: ClassVar[bool] = False

    def issue(self, worker: ActorHandle, key: str) -> ObjectRef:
        return worker.values.remote(key, self.tokens, self.lengths)


# the inference requests, each built from the tokens and optionally their rows' lengths (``run.overlap``
# re-issues one on row blocks)
InferenceCall = type[Logprobs] | type[LogprobsAndEntropy] | type[LogprobsEntropyAndSumPiSquared] | type[Values]


@dataclass(frozen=True)
class TrainStep:
    """One optimizer step on ``batch`` with ``loss_fn`` (``Worker.train_step``): changes the weights."""

    batch: TrainBatch
    loss_fn: LossFn
    lr: float
    max_grad_norm: float | None = None
    weight_decay: float = 0.0  # AdamW's decoupled decay
    changes_state: ClassVar[bool] = True

    def issue(self, worker: ActorHandle, key: str) -> ObjectRef:
        return worker.train_step.remote(key, self.batch, self.loss_fn, self.lr, self.max_grad_norm,
                                        self.weight_decay)


@dataclass(frozen=True)
class Generate:
    """New tokens per prompt (``Worker.generate``)."""

    prompts: list[list[int]]
    params: SamplingParams
    changes_state: ClassVar[bool] = False

    def issue(self, worker: ActorHandle, key: str) -> ObjectRef:
        return worker.generate.remote(key, self.prompts, self.params)


@dataclass(frozen=True)
class GenerateWithLogprobs:
    """New tokens and their sampling log-probs per prompt (``Worker.generate_with_logprobs``)."""

    prompts: list[list[int]]
    params: SamplingParams
    changes_state: ClassVar[bool] = False

    def issue(self, worker: ActorHandle, key: str) -> ObjectRef:
        return worker.generate_with_logprobs.remote(key, self.prompts, self.params)


@dataclass(frozen=True)
class GenOpen:
    """A generation engine that lives across calls, on each replica's rows (``Worker.gen_open``)."""

    prompts: list[list[int]]
    params: SamplingParams
    changes_state: ClassVar[bool] = False

    def issue(self, worker: ActorHandle, key: str) -> ObjectRef:
        return worker.gen_open.remote(key, self.prompts, self.params)


@dataclass(frozen=True)
class GenRun:
    """Up to ``iterations`` iterations of the key's engine (``Worker.gen_run``)."""

    iterations: int
    changes_state: ClassVar[bool] = False

    def issue(self, worker: ActorHandle, key: str) -> ObjectRef:
        return worker.gen_run.remote(key, self.iterations)


@dataclass(frozen=True)
class GenSpeculate:
    """The key's engine's n-gram speculation switched for its next iterations (``Worker.gen_speculate``;
    None: off); each replica answers its (draft tokens, accepted tokens) so far."""

    speculation: Speculation | None
    changes_state: ClassVar[bool] = False

    def issue(self, worker: ActorHandle, key: str) -> ObjectRef:
        return worker.gen_speculate.remote(key, self.speculation)


@dataclass(frozen=True)
class GenClose:
    """The key's engine run to the end and dropped (``Worker.gen_close``)."""

    changes_state: ClassVar[bool] = False

    def issue(self, worker: ActorHandle, key: str) -> ObjectRef:
        return worker.gen_close.remote(key)


@dataclass(frozen=True)
class GenMigrate:
    """Unfinished sequences moved between ``key``'s replicas (``Worker.gen_migrate``; every worker votes),
    by the key's engine (``Engine.migrate``)."""

    key: str
    plan: MigrationPlan

    def issue(self, worker: ActorHandle) -> ObjectRef:
        return worker.gen_migrate.remote(self.key, self.plan)
