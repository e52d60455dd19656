"""What a generation call answers: each row kept, carried or deferred, and how the decoding went; and the
stop rule of tail batching and partial rollout, shared by both native generation paths (the fixed batch,
``fixed_decode``; continuous batching, ``decode_engine``).

A round over-launches groups (a GRPO group: ``group_size`` consecutive rows answering one prompt) and
stops once ``keep`` whole groups of the replica have finished, its ``must`` lowest-numbered groups among
them (RollPacker, arXiv 2509.21009; partial rollout's carried groups, which must finish in the step after
the one that started them). Groups are kept in the order they finished; those finishing in one iteration
lowest-numbered first, so the answer does not depend on timing.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import astuple, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Carried:
    """A row a partial-rollout round aborted: what it generated so far, and whether it had finished
    (a finished member of a group that did not finish)."""

    tokens: list[int]
    logprobs: list[float]
    done: bool


# one row's answer to a round: (tokens, log-probs) when kept, ``Carried`` when carried, None when deferred
Answer = tuple[list[int], list[float]] | Carried | None


@dataclass(frozen=True)
class DecodeStats:
    """How a replica's generation went: decode forwards, those that verified drafts, and the speculation's
    counters as vLLM's ``spec_decode`` metrics count them: chains of drafts verified (one per sequence per
    verification, ``num_drafts``), draft tokens verified (``num_draft_tokens``), drafts accepted
    (``num_accepted_tokens``)."""

    iterations: int = 0
    speculative_iterations: int = 0
    verifications: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def __add__(self, other: DecodeStats) -> DecodeStats:
        return DecodeStats(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


@dataclass(frozen=True)
class ReplicaRollout:
    """One data-parallel replica's answer to a generation call: its rows' answers, in row order, how the
    generation went, and, where ``SamplingParams.record_routes`` asked and the engine records them, each
    row's routes [positions fed, sparse layers, top_k] (``model.routes``; None: not recorded)."""

    rows: list[Answer]
    stats: DecodeStats = DecodeStats()
    routes: list[torch.Tensor] | None = None


class GroupOrder:
    """The order in which the whole groups of one replica's rows ``row_ids`` finish, and when a round with
    ``keep`` groups to keep (``must`` of them the lowest-numbered) may stop."""

    def __init__(self, row_ids: Iterable[int], group_size: int, keep: int, must: int = 0) -> None:
        self.groups: dict[int, set[int]] = {}
        for i in row_ids:
            self.groups.setdefault(i // group_size, set()).add(i)
        if not must <= keep <= len(self.groups):
            raise ValueError(f"need must_groups ({must}) <= keep_groups ({keep}) <= the replica's "
                             f"{len(self.groups)} groups")
        self.keep = keep
        self.required = set(sorted(self.groups)[:must])
        self.order: list[int] = []

    def update(self, finished: Collection[int]) -> None:
        """Record the groups whose every row is now in ``finished`` (row ids)."""
        seen = set(self.order)
        self.order += sorted(g for g, ids in self.groups.items() if g not in seen and ids <= finished)

    @property
    def satisfied(self) -> bool:
        """Whether the round may stop: ``keep`` groups finished, the required ones among them."""
        return self.required <= set(self.order) and len(self.order) >= self.keep

    def kept_rows(self) -> set[int]:
        """The rows of the groups kept: the required ones, then the others in their finish order."""
        chosen = [g for g in self.order if g in self.required] + [g for g in self.order if g not in self.required]
        return {i for g in chosen[: self.keep] for i in self.groups[g]}


@dataclass(frozen=True)
class ClosedReplica:
    """A replica's answer to ``gen_close``: every sequence it finished (its own and those moved in), by id:
    (tokens, log-probs); with the last call's iterations, rows and busy seconds (``ReplicaStatus``'s)."""

    replica: int
    done: Mapping[int, tuple[list[int], list[float]]]
    iterations: int
    rows: int
    busy_s: float


@dataclass(frozen=True)
class MigrationOutcome:
    """One worker's part of a migration: whether it committed (``error`` says why not), its wall time,
    the sequences it adopted and released, and the KV bytes it sent and received."""

    ok: bool
    error: str = ""
    wall_s: float = 0.0
    installed: tuple[int, ...] = ()
    released: tuple[int, ...] = ()
    bytes_sent: int = 0
    bytes_received: int = 0
