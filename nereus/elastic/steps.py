"""The vocabulary of a transition plan (``elastic.plan``): one frozen dataclass per step kind and per piece
kind, with named fields, plus the tensor groups pieces name and the memory effects steps have.

Steps (``STEP_KINDS``, by ``kind``) and the pieces they carry (``PIECE_KINDS``):

  free_early  drop buffers that carry no state (gradient buffers) or whose bytes sit in host memory
  offload     copy old buffers to host memory over PCIe (the memory detour)
  alloc       allocate a device's new buffers that are not kept in place
  keep        new buffers equal to old ones on the same device: reused, nothing moves
  copy        local re-slices from old buffers on the same device (or from their host copy)
  send        the pieces one device receives from one source device, chunked through staging buffers
  group       create a new layout's process groups
  commit      the commit point: before it the old layout is intact, after it the new one is complete
  free, drop_host, alloc_grads   after the commit: release old buffers and host copies, allocate the
              new gradient buffers

A live migration of unfinished sequences (``elastic.kvplan``) uses its own kinds (``KV_STEP_KINDS``,
``KV_PIECE_KINDS``) and ``commit``: ``kv_send`` (sequence records and KV-cache pieces one worker receives
from another), ``refill`` (a sequence rebuilt by re-prefill of its tokens), ``kv_free`` (after the commit).

A new kind of step or piece is one new class here, listed in ``STEP_KINDS`` or ``PIECE_KINDS``: the
JSON codec is generic over the dataclass fields (group ids and ints as numbers, box sets as nested lists).
This module imports only the box helpers, so no file cycle can run through it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, ClassVar

from nereus.elastic.boxes import BoxSet


def _encode(value: Any) -> Any:
    """A field value as JSON: records by their ``to_json``, tuples (box sets, ids) as nested lists."""
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    return value


def _tuples(value: Any) -> Any:
    """Nested JSON lists back as nested tuples (box sets, dependency ids)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


@dataclass(frozen=True)
class Group:
    """Tensors of one model that every layout of both plans shards alike (same shape, split and stage):
    a piece names a group and one box set that applies to each member tensor."""

    id: int
    model: str
    names: tuple[str, ...]
    shape: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.names)

    def to_json(self) -> dict:
        return {"id": self.id, "model": self.model, "names": list(self.names), "shape": list(self.shape)}

    @staticmethod
    def from_json(d: dict) -> Group:
        return Group(d["id"], d["model"], tuple(d["names"]), tuple(d["shape"]))


# ----- pieces: what part of which buffer a step touches --------------------------------------------------

class Piece:
    """Base of the piece kinds. Fields are ints (a group id) or box sets in global coordinates."""

    __slots__ = ()
    kind: ClassVar[str] = ""

    def to_json(self) -> dict:
        return {"kind": self.kind, **{f.name: _encode(getattr(self, f.name)) for f in fields(self)}}

    @classmethod
    def from_json(cls, d: dict) -> Piece:
        return cls(**{f.name: _tuples(d[f.name]) for f in fields(cls)})


@dataclass(frozen=True, slots=True)
class WholeBuffer(Piece):
    """A whole buffer: the boxes of group ``group`` one device holds (kept, allocated or freed)."""

    kind: ClassVar[str] = "buffer"
    group: int
    boxes: BoxSet


@dataclass(frozen=True, slots=True)
class LocalPiece(Piece):
    """A local re-slice: ``piece`` read from the old buffer ``source`` into the new buffer ``dest``."""

    kind: ClassVar[str] = "local"
    group: int
    piece: BoxSet
    source: BoxSet
    dest: BoxSet


@dataclass(frozen=True, slots=True)
class SentPiece(Piece):
    """A received piece: the sender reads ``piece`` from any old buffer of the group's tensors that holds it
    whole; the receiver writes it into its new buffer ``dest``."""

    kind: ClassVar[str] = "sent"
    group: int
    piece: BoxSet
    dest: BoxSet


@dataclass(frozen=True, slots=True)
class KVPiece(Piece):
    """Keys and values of sequence ``seq`` at positions [0, ``length``), layers [``layers``) and KV heads
    [``heads``) (half-open global index ranges)."""

    kind: ClassVar[str] = "kv"
    seq: int
    layers: tuple[int, int]
    heads: tuple[int, int]
    length: int


@dataclass(frozen=True, slots=True)
class SeqPiece(Piece):
    """Sequence ``seq``'s record without its caches: ``prompt`` + ``generated`` token ids, the generated
    tokens' log-probs and its sampling stream's state (``rng_bytes``)."""

    kind: ClassVar[str] = "seq"
    seq: int
    prompt: int
    generated: int
    rng_bytes: int


KV_PIECE_KINDS: Mapping[str, type[Piece]] = MappingProxyType({c.kind: c for c in (KVPiece, SeqPiece)})
PIECE_KINDS: Mapping[str, type[Piece]] = MappingProxyType(
    {c.kind: c for c in (WholeBuffer, LocalPiece, SentPiece, *KV_PIECE_KINDS.values())})


@dataclass(frozen=True, slots=True)
class StatePart:
    """The pieces of one model state (``actor``/``weights``) a step touches."""

    model: str
    state: str
    pieces: tuple[Piece, ...]

    def to_json(self) -> dict:
        return {"model": self.model, "state": self.state, "pieces": [p.to_json() for p in self.pieces]}

    @staticmethod
    def from_json(d: dict) -> StatePart:
        return StatePart(d["model"], d["state"], tuple(_kind(PIECE_KINDS, p).from_json(p) for p in d["pieces"]))


def _kind(registry: Mapping[str, type], d: dict) -> type:
    """The class registered for ``d["kind"]``; a ``ValueError`` naming the known kinds otherwise."""
    cls = registry.get(d.get("kind"))
    if cls is None:
        raise ValueError(f"unknown kind {d.get('kind')!r}; known: {', '.join(registry)}")
    return cls


def _labels(parts: tuple[StatePart, ...]) -> tuple[str, str]:
    """Labels of the model states a step touches ("actor+critic", "optimizer+weights")."""
    return "+".join(sorted({p.model for p in parts})), "+".join(sorted({p.state for p in parts}))


# ----- memory effects ----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Delta:
    device: int
    bytes: int  # signed: positive allocates


@dataclass(frozen=True, slots=True)
class MemoryEffects:
    """Device memory changes applied when a step starts and when it ends."""

    at_start: tuple[Delta, ...] = ()
    at_end: tuple[Delta, ...] = ()


NO_EFFECTS = MemoryEffects()


# ----- steps --------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Step:
    """Base of the step kinds: ``id`` is the step's index in the plan, ``deps`` the steps it waits for.
    ``after_commit``: the kind runs after the commit point (it releases the old layout)."""

    id: int
    deps: tuple[int, ...]
    kind: ClassVar[str] = ""
    after_commit: ClassVar[bool] = False

    def memory(self) -> MemoryEffects:
        return NO_EFFECTS

    def all_pieces(self) -> Iterator[Piece]:
        for part in getattr(self, "parts", ()):
            yield from part.pieces

    @property
    def model(self) -> str:
        """The models whose state the step carries ("actor+critic"); steps without parts have none."""
        return _labels(getattr(self, "parts", ()))[0]

    @property
    def state(self) -> str:
        return _labels(getattr(self, "parts", ()))[1]

    def to_json(self) -> dict:
        return {"kind": self.kind, **{f.name: _encode(getattr(self, f.name)) for f in fields(self)}}

    @classmethod
    def from_json(cls, d: dict) -> Step:
        kw = {}
        for f in fields(cls):
            v = d[f.name]
            kw[f.name] = tuple(StatePart.from_json(p) for p in v) if f.name == "parts" else _tuples(v)
        return cls(**kw)


@dataclass(frozen=True, slots=True)
class BufferStep(Step):
    """A step on one device's buffers (``bytes``: their total, every model state in ``parts``).
    ``sign``: +1 allocates them on the device, −1 releases them, 0 leaves device memory as it is."""

    device: int
    bytes: int
    parts: tuple[StatePart, ...]
    sign: ClassVar[int] = 0

    def memory(self) -> MemoryEffects:
        return MemoryEffects((Delta(self.device, self.sign * self.bytes),)) if self.sign else NO_EFFECTS


@dataclass(frozen=True, slots=True)
class FreeEarly(BufferStep):
    """Release before the commit: gradient buffers (no state between steps), or old buffers once their
    bytes sit in host memory (the step then depends on their ``offload``)."""

    kind: ClassVar[str] = "free_early"
    sign: ClassVar[int] = -1


@dataclass(frozen=True, slots=True)
class Offload(BufferStep):
    """Old buffers copied to host memory over PCIe (a memory detour), restorable until the commit."""

    kind: ClassVar[str] = "offload"


@dataclass(frozen=True, slots=True)
class Alloc(BufferStep):
    kind: ClassVar[str] = "alloc"
    sign: ClassVar[int] = 1


@dataclass(frozen=True, slots=True)
class Keep(BufferStep):
    """New buffers equal to old ones on the same device: handed over, nothing moves."""

    kind: ClassVar[str] = "keep"


@dataclass(frozen=True, slots=True)
class Copy(BufferStep):
    """Local re-slices (``LocalPiece``), from device memory or, with ``from_host``, from the host copy."""

    kind: ClassVar[str] = "copy"
    from_host: bool = False


@dataclass(frozen=True, slots=True)
class Free(BufferStep):
    kind: ClassVar[str] = "free"
    after_commit: ClassVar[bool] = True
    sign: ClassVar[int] = -1


@dataclass(frozen=True, slots=True)
class DropHost(BufferStep):
    """Release the host copies of a memory detour."""

    kind: ClassVar[str] = "drop_host"
    after_commit: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class AllocGrads(BufferStep):
    kind: ClassVar[str] = "alloc_grads"
    after_commit: ClassVar[bool] = True
    sign: ClassVar[int] = 1


@dataclass(frozen=True, slots=True)
class Send(Step):
    """The pieces (``SentPiece``) device ``dst`` receives from device ``src``, every model state coalesced;
    ``chunks`` messages through ``staging`` bytes of buffer at each GPU end (the receiver's only when
    ``from_host``: the pieces then leave the source's host memory)."""

    kind: ClassVar[str] = "send"
    src: int
    dst: int
    bytes: int
    parts: tuple[StatePart, ...]
    from_host: bool
    chunks: int
    staging: int

    def memory(self) -> MemoryEffects:
        ends = (self.dst,) if self.from_host else (self.dst, self.src)
        return MemoryEffects(tuple(Delta(d, self.staging) for d in ends),
                             tuple(Delta(d, -self.staging) for d in ends))


@dataclass(frozen=True, slots=True)
class CreateGroups(Step):
    """The process groups of one new layout (``layout``: its short form) on ``gpus``."""

    kind: ClassVar[str] = "group"
    model_stage: str
    layout: str
    gpus: tuple[int, ...]

    @property
    def device(self) -> int:
        return self.gpus[0]

    @property
    def detail(self) -> str:
        return f"{self.model_stage} {self.layout} on {len(self.gpus)} GPUs"


@dataclass(frozen=True, slots=True)
class Commit(Step):
    """The commit point: every step before the commit is among ``deps``."""

    kind: ClassVar[str] = "commit"


@dataclass(frozen=True, slots=True)
class KVSend(Step):
    """Sequence records and KV pieces ``dst`` receives from ``src`` in a live migration (``src == dst``: a
    copy between two engines of one worker); ``bytes``: the caches' bytes, allocated at ``dst``."""

    kind: ClassVar[str] = "kv_send"
    src: int
    dst: int
    bytes: int
    parts: tuple[StatePart, ...]

    def memory(self) -> MemoryEffects:
        return MemoryEffects((Delta(self.dst, self.bytes),))


@dataclass(frozen=True, slots=True)
class Refill(BufferStep):
    """Sequences (``SeqPiece``) whose caches ``device`` rebuilds by re-prefill of their tokens."""

    kind: ClassVar[str] = "refill"
    sign: ClassVar[int] = 1


@dataclass(frozen=True, slots=True)
class KVFree(BufferStep):
    """After the commit: the source releases the migrated sequences and their caches."""

    kind: ClassVar[str] = "kv_free"
    after_commit: ClassVar[bool] = True
    sign: ClassVar[int] = -1


KV_STEP_KINDS: Mapping[str, type[Step]] = MappingProxyType({c.kind: c for c in (KVSend, Refill, KVFree)})
STEP_KINDS: Mapping[str, type[Step]] = MappingProxyType({c.kind: c for c in (
    FreeEarly, Offload, Alloc, Keep, Copy, Send, CreateGroups, Commit, Free, DropHost, AllocGrads,
    *KV_STEP_KINDS.values())})


def step_from_json(d: dict) -> Step:
    return _kind(STEP_KINDS, d).from_json(d)
