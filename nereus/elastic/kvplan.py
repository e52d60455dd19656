"""The plan of a live migration of unfinished sequences between generation placements, as typed steps.

A sequence mid-generation is its record (prompt and generated tokens, their log-probs, its sampling
stream's state) and its KV caches: per layer, keys and values of its positions for the KV heads each rank
holds. Under a placement (a ``Layout`` on global ranks) rank (pp, dp, tp) holds the layers of its pipeline
stage (``spec.sharding.layer_range``) and the KV heads ``kv_head_range`` says (the K/V projection boxes of
``spec.sharding.tp_box``). Moving a sequence from a replica of one placement to a replica of another is
then a set of range intersections, like the weights' boxes in ``elastic.geometry``:

- every destination rank receives the record (``SeqPiece``) from the source replica's output rank (last
  stage, TP rank 0: the one whose sampling stream advanced) and, for each (layer range, KV-head range)
  of its own shard, the pieces (``KVPiece``) of the source ranks holding them — one source per head range
  (preferring the destination's own rank, then the lowest TP rank, when TP replicates a KV head). A TP
  change splits (1→2) or merges (2→1) heads; a DP change moves whole sequences between replicas;
- or, for a sequence marked ``refill``, only the record: the destination re-prefills its tokens
  (``Refill``) instead of receiving caches (cheaper when the link is slow or the sequence short);
- ``commit`` follows every transfer; ``kv_free`` after it releases the sources. The runtime
  (``runtime.engines.native.kv_migrate``) frees nothing before every rank voted at the commit point, so a failure leaves
  every sequence where it was.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from nereus.elastic.plan import (
    Commit,
    KVFree,
    KVPiece,
    KVSend,
    Refill,
    SeqPiece,
    StatePart,
    Step,
    step_from_json,
)
from nereus.spec.layout import Layout
from nereus.spec.model import kv_token_bytes
from nereus.spec.sharding import layer_range, split_range

FORMAT = "nereus.kv-migration/1"


def kv_head_range(kv_heads: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """The KV heads [lo, hi) TP rank ``tp_rank`` of ``tp`` holds: an even split, or, when TP exceeds the
    KV heads, the one head it shares with ``tp // kv_heads - 1`` neighbours (``spec.sharding.tp_box``)."""
    if tp <= kv_heads:
        return split_range(kv_heads, tp, tp_rank)
    lo = tp_rank * kv_heads // tp
    return lo, lo + 1


@dataclass(frozen=True)
class KVShape:
    """What sizes a model's caches: decoder layers, KV heads, head width, bytes per element."""

    layers: int
    kv_heads: int
    head_dim: int
    elem_bytes: int

    @property
    def token_bytes(self) -> int:
        """Keys and values of one position over every layer and KV head (``spec.model.kv_token_bytes``)."""
        return kv_token_bytes(self.layers, self.kv_heads, self.head_dim, self.elem_bytes)

    def piece_bytes(self, p: KVPiece) -> int:
        """Keys and values of a piece."""
        span = kv_token_bytes(p.layers[1] - p.layers[0], p.heads[1] - p.heads[0], self.head_dim, self.elem_bytes)
        return span * p.length


@dataclass(frozen=True)
class GenPlacement:
    """A generation placement: ``layout`` on global ``ranks`` (in ``Layout.rank`` order)."""

    layout: Layout
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.ranks) != self.layout.world:
            raise ValueError(f"layout {self.layout.short()} needs {self.layout.world} ranks, got {self.ranks}")

    def shard(self, dp: int, shape: KVShape) -> Iterator[tuple[int, int, tuple[int, int], tuple[int, int]]]:
        """(global rank, tp rank, layers, KV heads) of every rank of replica ``dp``."""
        dims = self.layout.dims
        for p in range(dims.pp):
            layers = layer_range(shape.layers, dims.pp, p)
            for t in range(dims.tp):
                yield (self.ranks[dims.rank(p, dp, t)], t, (layers.start, layers.stop),
                       kv_head_range(shape.kv_heads, dims.tp, t))

    def output_rank(self, dp: int) -> int:
        dims = self.layout.dims
        return self.ranks[dims.rank(dims.pp - 1, dp, 0)]


@dataclass(frozen=True)
class SeqMove:
    """One unfinished sequence to move (its ``runtime.engines.native.decode_engine.SeqInfo`` numbers): from replica
    ``src`` of the source placement to replica ``dst`` of the destination; ``refill``: send the record
    only and re-prefill there."""

    seq: int
    prompt: int
    generated: int
    cached: int
    rng_bytes: int
    src: int
    dst: int
    refill: bool = False


@dataclass(frozen=True)
class MigrationPlan:
    """The steps of one migration (ids = positions) and the numbers that size its pieces."""

    model: str
    shape: KVShape
    steps: tuple[Step, ...]

    @property
    def commit(self) -> int:
        return next(s.id for s in self.steps if isinstance(s, Commit))

    @property
    def bytes_sent(self) -> int:
        """KV bytes crossing between two ranks (local copies excluded)."""
        return sum(s.bytes for s in self.steps if isinstance(s, KVSend) and s.src != s.dst)

    def sends(self) -> list[KVSend]:
        return [s for s in self.steps if isinstance(s, KVSend)]

    def to_json(self) -> dict:
        return {"format": FORMAT, "model": self.model, "shape": vars(self.shape),
                "steps": [s.to_json() for s in self.steps]}

    @staticmethod
    def from_json(d: dict) -> MigrationPlan:
        if d.get("format") != FORMAT:
            raise ValueError(f"format: expected {FORMAT!r}, got {d.get('format')!r}")
        steps = tuple(step_from_json(s) for s in d["steps"])
        if any(s.id != i for i, s in enumerate(steps)):
            raise ValueError("steps: ids must be 0, 1, ... in order")
        return MigrationPlan(d["model"], KVShape(**d["shape"]), steps)


def _kv_sources(src: GenPlacement, move: SeqMove, shape: KVShape, dst_rank: int, layers: tuple[int, int],
                heads: tuple[int, int]) -> Iterator[tuple[int, KVPiece]]:
    """(source rank, piece) covering ``layers`` × ``heads`` of a destination rank, one source per range."""
    by_range: dict[tuple[tuple[int, int], tuple[int, int]], int] = {}
    for rank, _t, s_layers, s_heads in src.shard(move.src, shape):
        lo, hi = max(layers[0], s_layers[0]), min(layers[1], s_layers[1])
        hlo, hhi = max(heads[0], s_heads[0]), min(heads[1], s_heads[1])
        if lo >= hi or hlo >= hhi:
            continue
        key = ((lo, hi), (hlo, hhi))
        if key not in by_range or rank == dst_rank:  # replicated head: keep the lowest TP rank or our own
            by_range[key] = rank
    for (lrange, hrange), rank in sorted(by_range.items()):
        yield rank, KVPiece(move.seq, lrange, hrange, move.cached)


def plan_migration(model: str, shape: KVShape, src: GenPlacement, dst: GenPlacement,
                   moves: Sequence[SeqMove]) -> MigrationPlan:
    """Every step of moving ``moves`` from ``src`` to ``dst`` (see the module docstring)."""
    pairs: dict[tuple[int, int], tuple[list[SeqPiece], list[KVPiece]]] = {}
    refills: dict[int, list[SeqPiece]] = {}
    for m in moves:
        if not (0 <= m.src < src.layout.dp and 0 <= m.dst < dst.layout.dp):
            raise ValueError(f"moves: sequence {m.seq} goes from replica {m.src} to {m.dst}, outside dp "
                             f"{src.layout.dp} and {dst.layout.dp}")
        record = SeqPiece(m.seq, m.prompt, m.generated, m.rng_bytes)
        for rank, _t, layers, heads in dst.shard(m.dst, shape):
            pairs.setdefault((src.output_rank(m.src), rank), ([], []))[0].append(record)
            if m.refill:
                refills.setdefault(rank, []).append(record)
            elif m.cached:
                for source, piece in _kv_sources(src, m, shape, rank, layers, heads):
                    pairs.setdefault((source, rank), ([], []))[1].append(piece)
    steps: list[Step] = []
    for (s, d), (records, pieces) in sorted(pairs.items()):
        parts = tuple(StatePart(model, state, tuple(ps)) for state, ps in (("seq", records), ("kv", pieces)) if ps)
        steps.append(KVSend(len(steps), (), s, d, sum(shape.piece_bytes(p) for p in pieces), parts))
    for rank, records in sorted(refills.items()):
        nbytes = sum(shape.token_bytes * (r.prompt + r.generated)
                     for r in records)  # an upper bound: the whole model's heads, not this rank's shard
        steps.append(Refill(len(steps), (), rank, nbytes, (StatePart(model, "seq", tuple(records)),)))
    commit = len(steps)
    steps.append(Commit(commit, tuple(range(commit))))
    freed: dict[int, list[SeqPiece]] = {}
    for m in moves:
        for rank, *_ in src.shard(m.src, shape):
            freed.setdefault(rank, []).append(SeqPiece(m.seq, m.prompt, m.generated, m.rng_bytes))
    for rank, records in sorted(freed.items()):
        steps.append(KVFree(len(steps), (commit,), rank, 0, (StatePart(model, "seq", tuple(records)),)))
    return MigrationPlan(model, shape, tuple(steps))
