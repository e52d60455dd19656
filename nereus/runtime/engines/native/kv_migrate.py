"""Execute a live migration of unfinished sequences (``elastic.kvplan.MigrationPlan``) between decode
engines (``runtime.engines.native.decode_engine``) on the ranks of one torch.distributed world.

Every rank of the world calls ``migrate`` with the same plan, between two engine iterations, passing the
engine its source placement runs on this rank (or None) and the one its destination placement runs (or
None; it may be the same object, e.g. the surviving replica of a DP2→DP1 change). Phases:

1. *move*: every ``kv_send`` this rank takes part in is posted at once over the transfer group of
   ``executor.TransferComm`` — per step one message of records (tokens, log-probs, stream state; packed
   bytes) and one of KV pieces (packed values), sizes known from the plan on both ends; a step whose
   source and destination are this rank is a local copy. Received pieces land in caches the destination
   engine allocates, outside the engine;
2. *commit vote* over the control group: the commit point. Only when every rank received and built all
   its sequences does the destination engine adopt them and the source engine release them
   (``kv_free``). Otherwise every rank drops what it received and the sources keep running their
   sequences as if nothing happened: a failure loses nothing.

Fault points (``faults.FaultHook``): ``migration.transfer`` before this rank posts its messages (a peer
waiting for them times out), ``migration.install`` after every piece landed, before the vote.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nereus.elastic.kvplan import MigrationPlan, kv_head_range
from nereus.elastic.plan import KVFree, KVPiece, KVSend, Refill, SeqPiece
from nereus.runtime.comm.faults import FaultHook
from nereus.runtime.comm.transfer import TransferComm
from nereus.runtime.engines.native.decode_engine import DecodeEngine, Sequence

I64, F64 = 8, 8  # bytes of a token id and of a log-prob on the wire


class MigrationAborted(RuntimeError):
    """The migration did not commit; every sequence is still where it was."""


@dataclass
class MigrationResult:
    """This rank's part: sequences adopted and released here, bytes over the wire."""

    installed: list[int] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0


def _pieces(step: KVSend, state: str) -> list:
    return [p for part in step.parts if part.state == state for p in part.pieces]


def record_bytes(p: SeqPiece) -> int:
    return (p.prompt + p.generated) * I64 + p.generated * F64 + p.rng_bytes


def pack_records(engine: DecodeEngine, records: list[SeqPiece]) -> torch.Tensor:
    held = engine.sequences()
    parts = []
    for p in records:
        s = held[p.seq]
        if len(s.prompt) != p.prompt or len(s.tokens) != p.generated:
            raise ValueError(f"sequence {p.seq} is at {len(s.prompt)}+{len(s.tokens)} tokens, the plan says "
                             f"{p.prompt}+{p.generated}")
        parts += [torch.tensor(s.all_tokens(), dtype=torch.int64).view(torch.uint8),
                  torch.tensor(s.logprobs, dtype=torch.float64).view(torch.uint8), s.gen.get_state()]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def unpack_records(engine: DecodeEngine, records: list[SeqPiece], flat: torch.Tensor) -> list[Sequence]:
    """Sequences rebuilt from their records (no caches yet), with the destination's cache length."""
    out, at = [], 0
    for p in records:
        n = p.prompt + p.generated
        ids = flat[at: at + n * I64].view(torch.int64).tolist()
        at += n * I64
        logps = flat[at: at + p.generated * F64].view(torch.float64).tolist()
        at += p.generated * F64
        gen = torch.Generator(device=engine.sm.groups.device)
        gen.set_state(flat[at: at + p.rng_bytes].clone())
        at += p.rng_bytes
        out.append(Sequence(p.seq, ids[: p.prompt], p.prompt + engine.params.max_new_tokens, ids[p.prompt:],
                            logps, gen))
    return out


def _head_offset(engine: DecodeEngine) -> int:
    g = engine.sm.groups
    return kv_head_range(engine.sm.cfg.arch.kv_heads, g.dims.tp, g.coords.tp_rank)[0]


def _kv_views(seq: Sequence, piece: KVPiece, head0: int) -> list[torch.Tensor]:
    """The keys and values of ``piece`` inside ``seq``'s caches (this rank's heads start at ``head0``)."""
    a, b = piece.heads[0] - head0, piece.heads[1] - head0
    out = []
    for layer in range(*piece.layers):
        c = seq.caches[layer]
        out += [c.k[0, a:b, : piece.length], c.v[0, a:b, : piece.length]]
    return out


def pack_kv(engine: DecodeEngine, pieces: list[KVPiece]) -> torch.Tensor:
    held, head0 = engine.sequences(), _head_offset(engine)
    views = [v.reshape(-1) for p in pieces for v in _kv_views(held[p.seq], p, head0)]
    return torch.cat(views) if views else torch.empty(0, dtype=engine.sm.dtype)


def unpack_kv(engine: DecodeEngine, built: dict[int, Sequence], pieces: list[KVPiece], flat: torch.Tensor) -> None:
    head0, at = _head_offset(engine), 0
    for p in pieces:
        seq = built[p.seq]
        if seq.caches is None:
            seq.caches = engine._new_caches(seq.max_len)
        elif seq.cached != p.length:
            raise ValueError(f"sequence {p.seq}: pieces of {seq.cached} and {p.length} positions")
        seq.cached = p.length
        for v in _kv_views(seq, p, head0):
            v.copy_(flat[at: at + v.numel()].view(v.shape))
            at += v.numel()


class _Move:
    """One rank's phase 1: post, wait, build the destination's sequences."""

    def __init__(self, plan: MigrationPlan, src: DecodeEngine | None, dst: DecodeEngine | None,
                 comm: TransferComm, result: MigrationResult) -> None:
        self.plan, self.src, self.dst, self.comm, self.result = plan, src, dst, comm, result
        self.me = dist.get_rank()
        self.dtype = dst.sm.dtype if dst is not None else None  # what this rank receives into

    def _kv_numel(self, pieces: list[KVPiece]) -> int:
        return sum(self.plan.shape.piece_bytes(p) for p in pieces) // self.plan.shape.elem_bytes

    def run(self) -> dict[int, Sequence]:
        ops, landing = [], []
        for step in self.plan.sends():
            if self.me not in (step.src, step.dst):
                continue
            records, pieces = _pieces(step, "seq"), _pieces(step, "kv")
            if step.src == step.dst:
                landing.append((step, pack_records(self.src, records), pack_kv(self.src, pieces)))
                continue
            if step.src == self.me:
                for tag, flat in enumerate((pack_records(self.src, records), pack_kv(self.src, pieces))):
                    if flat.numel():
                        ops.append(dist.P2POp(dist.isend, flat, step.dst, group=self.comm.transfer, tag=tag))
                        self.result.bytes_sent += flat.nbytes
            else:
                flat_r = torch.empty(sum(record_bytes(p) for p in records), dtype=torch.uint8)
                flat_kv = torch.empty(self._kv_numel(pieces), dtype=self.dtype)
                for tag, flat in enumerate((flat_r, flat_kv)):
                    if flat.numel():
                        ops.append(dist.P2POp(dist.irecv, flat, step.src, group=self.comm.transfer, tag=tag))
                        self.result.bytes_received += flat.nbytes
                landing.append((step, flat_r, flat_kv))
        if ops:
            self.comm.wait(dist.batch_isend_irecv(ops))
        return self._build(landing)

    def _build(self, landing: list) -> dict[int, Sequence]:
        built: dict[int, Sequence] = {}
        for step, flat_r, _ in landing:  # every record first: KV pieces may come from other ranks
            for seq in unpack_records(self.dst, _pieces(step, "seq"), flat_r):
                built[seq.seq_id] = seq
        for step, _, flat_kv in landing:
            unpack_kv(self.dst, built, _pieces(step, "kv"), flat_kv)
        for step in self.plan.steps:
            if isinstance(step, Refill) and step.device == self.me:
                for p in step.all_pieces():
                    built[p.seq].caches, built[p.seq].cached = None, 0
        return built


def _releasable(plan: MigrationPlan, src: DecodeEngine | None) -> None:
    """Before the vote: this rank can release what the plan's ``kv_free`` steps say (so nothing after the
    commit point can fail on a plan that does not match the engines)."""
    me = dist.get_rank()
    ids = {p.seq for s in plan.steps if isinstance(s, KVFree) and s.device == me for p in s.all_pieces()}
    if ids and src is None:
        raise ValueError(f"the plan frees sequences {sorted(ids)} here, but this rank has no source engine")
    missing = ids - {s.seq_id for s in src.unfinished()} if ids else set()
    if missing:
        raise ValueError(f"the plan frees sequences {sorted(missing)}, which are not unfinished here")


def migrate(plan: MigrationPlan, src: DecodeEngine | None, dst: DecodeEngine | None, comm: TransferComm,
            faults: FaultHook | None = None) -> MigrationResult:
    """This rank's part of ``plan`` (collective over the world); raises ``MigrationAborted`` on every rank,
    with every sequence left where it was, when any rank failed before the commit point."""
    result, err, built = MigrationResult(), "", {}
    try:
        if faults is not None:
            faults.at("migration.transfer")
        _releasable(plan, src)
        built = _Move(plan, src, dst, comm, result).run()
        if faults is not None:
            faults.at("migration.install")
    except Exception as exc:  # noqa: BLE001 - any failure must reach the vote, not hang the others
        err = f"rank {dist.get_rank()}: {type(exc).__name__}: {exc}"
    error = comm.vote(err)  # the commit point: nobody has changed an engine yet
    if error:
        comm.renew()  # unmatched messages of the failed attempt may still sit in the transfer group
        raise MigrationAborted(f"migration aborted, every sequence stays where it was: {error}")
    me = dist.get_rank()
    if built:
        dst.install([built[i] for i in sorted(built)])
        result.installed = sorted(built)
    for step in plan.steps:
        if isinstance(step, KVFree) and step.device == me:
            ids = [p.seq for p in step.all_pieces()]
            if dst is src:  # a replica that keeps some sequences and sends others: send only the others
                ids = [i for i in ids if i not in built]
            src.take(ids)
            result.released += ids
    return result
