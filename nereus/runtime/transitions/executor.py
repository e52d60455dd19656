"""Execute a transition graph on the ranks of one torch.distributed world (graph device ``d`` = rank ``d``).

``nereus.elastic.build_graph`` plans the move of every model state between two plans as typed steps per
device (``nereus.elastic.plan``): ``Keep`` (a new buffer equal to an old one: handed over, not copied),
``Copy`` (local re-slices), ``Send`` (the pieces one device receives from one source, every model state
coalesced, chunked), ``Free`` (after the commit point). Every rank runs an ``Execution`` of the same plan
with its own ``Holdings``:

1. *prepare*: resolve every piece this rank reads or writes against its buffers, then vote (all ranks,
   over a control group) — a rank that cannot follow the graph aborts the transition before anything moves;
2. *allocate* the new buffers the graph does not keep, *copy* the local pieces;
3. *transfer* in rounds: each send is cut at box boundaries (rows) into chunks of at most the graph's
   ``chunk_bytes``; a round gives each rank at most one outgoing and one incoming chunk (the graph's one
   egress and one ingress port per device), packed byte-exact into one staging buffer per transfer and
   exchanged with one ``batch_isend_irecv`` over a dedicated transfer group, with a timeout;
4. *check* that every new buffer was written whole; the caller installs the new layout and calls
   ``commit_vote``: only when every rank succeeded does anyone drop the old buffers.

Before the commit vote nothing old is modified (kept buffers are shared read-only, new buffers are fresh),
so any failure — an exception, a peer that never sends (the wait times out) — leaves every rank able to go
on training on the old layout (rollback = drop the new buffers). Peak memory is accounted as the bytes of
the distinct storages alive (old, new, staging) at every phase, comparable with the graph's schedule.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nereus.elastic.plan import Copy, Keep, Send, Step, TransitionPlan
from nereus.runtime.comm.faults import FaultHook, InjectedFault
from nereus.runtime.comm.transfer import TransferComm, TransitionExecutionError
from nereus.runtime.transitions.holdings import (
    WEIGHTS,
    Buffer,
    BufferKey,
    Holdings,
    extent,
    storage_bytes,
)
from nereus.spec.sharding import Box, box_volume

DATA_STATES = ("weights", "optimizer")  # gradient buffers carry nothing across a step boundary
# entries of at least this many bytes travel as their own messages, straight between old and new buffers;
# smaller ones (norms, biases, row fragments of ZeRO ranges) are packed into one message per transfer
DIRECT_BYTES = 1 << 16
ALIGN = 8  # bytes: every entry starts aligned in the byte stream so it can be viewed as its dtype


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor's box of a transfer: the sender reads it from any old buffer that holds it, the receiver
    writes it into its new buffer ``dest``."""

    model: str
    state: str
    tensor: str
    box: Box
    dest: tuple[Box, ...]

    @property
    def dest_key(self) -> BufferKey:
        return (self.model, self.state, self.tensor, self.dest)


@dataclass
class TransferMeasures:
    """What one rank measured during a transition (bytes are payload; peak is live storage bytes)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_copied: int = 0
    bytes_kept: int = 0
    rounds: int = 0
    peak_bytes: int = 0
    start_bytes: int = 0
    end_bytes: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    error: str = ""

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class NewBuffers:
    """What a rank needs after the transition: buffer key → component dtypes (one for weights)."""

    needs: dict[BufferKey, tuple[torch.dtype, ...]]
    device: torch.device = torch.device("cpu")


def _data_parts(step: Step) -> list:
    """The step's parts of states that carry data across a step boundary (not gradient buffers)."""
    return [part for part in getattr(step, "parts", ()) if part.state in DATA_STATES]


def send_entries(step: Send, graph: TransitionPlan) -> list[Entry]:
    """The pieces of a ``Send`` per member tensor, in the order both ends pack them."""
    return [Entry(part.model, part.state, name, box, p.dest) for part in _data_parts(step) for p in part.pieces
            for name in graph.groups[p.group].names for box in p.piece]


def element_bytes(model_dtypes: dict[str, torch.dtype], model: str, state: str) -> int:
    """Bytes per element of a state on the wire: all components of it."""
    if state == WEIGHTS:
        return model_dtypes[model].itemsize
    return 3 * 4  # fp32 master, exp_avg, exp_avg_sq


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _split_rows(box: Box, rows: int) -> list[Box]:
    """``box`` cut along its first dimension into blocks of at most ``rows`` rows (each again a box)."""
    lo, hi = box[0]
    return [((a, min(a + rows, hi)), *box[1:]) for a in range(lo, hi, rows)]


def chunk_entries(entries: list[Entry], sizes: dict[tuple[str, str], int], chunk: int) -> list[list[Entry]]:
    """Entries cut at row boundaries and packed greedily into chunks of at most ``chunk`` bytes (a single
    row larger than a chunk travels alone). Deterministic, so both ends agree."""
    out: list[list[Entry]] = [[]]
    used = 0
    for e in entries:
        size = sizes[(e.model, e.state)]
        per_row = size * box_volume(e.box) // max(1, e.box[0][1] - e.box[0][0])
        for sub in _split_rows(e.box, max(1, chunk // max(1, per_row))):
            n = _align(size * box_volume(sub))
            if out[-1] and used + n > chunk:
                out.append([])
                used = 0
            out[-1].append(Entry(e.model, e.state, e.tensor, sub, e.dest))
            used += n
    return [c for c in out if c]


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    entries: tuple[Entry, ...]
    nbytes: int


def plan_rounds(graph: TransitionPlan, model_dtypes: dict[str, torch.dtype]) -> list[list[Transfer]]:
    """Every chunk of every send, in rounds where a rank sends at most one chunk and receives at most one
    (list scheduling in the plan's step order; the same on every rank)."""
    sizes = {}
    next_send: dict[int, int] = {}
    next_recv: dict[int, int] = {}
    rounds: list[list[Transfer]] = []
    for step in graph.steps:
        if not isinstance(step, Send) or step.src == step.dst:
            continue
        entries = send_entries(step, graph)
        for e in entries:
            sizes.setdefault((e.model, e.state), element_bytes(model_dtypes, e.model, e.state))
        for chunk in chunk_entries(entries, sizes, graph.chunk_bytes):
            nbytes = sum(_align(sizes[(e.model, e.state)] * box_volume(e.box)) for e in chunk)
            r = max(next_send.get(step.src, 0), next_recv.get(step.dst, 0))
            while len(rounds) <= r:
                rounds.append([])
            rounds[r].append(Transfer(step.src, step.dst, tuple(chunk), nbytes))
            next_send[step.src] = next_recv[step.dst] = r + 1
    return rounds


class Execution:
    """One rank's part of one transition (see the module docstring). ``run`` returns what ``install``
    built from the new buffers once every rank voted to commit; otherwise it raises
    ``TransitionExecutionError`` on every rank and the old buffers are untouched. ``faults``: this worker's
    fault hook; a test's fault plan may fail or kill it at ``transition.<phase>``."""

    def __init__(self, graph: TransitionPlan, old: Holdings, new: NewBuffers, comm: TransferComm,
                 model_dtypes: dict[str, torch.dtype], faults: FaultHook | None = None,
                 resident: list[torch.Tensor] | None = None, fault_scope: str = "transition") -> None:
        self.graph, self.old, self.new, self.comm = graph, old, new, comm
        self.dtypes, self.faults, self.fault_scope = model_dtypes, faults, fault_scope
        self.resident = list(resident or [])  # other tensors alive throughout (counted in the peak)
        self.me = dist.get_rank()
        self.rounds = plan_rounds(graph, model_dtypes)  # the same on every rank; prepare and transfer use it
        self.out = Holdings()
        self.measured = TransferMeasures()
        self._staging: list[torch.Tensor] = []

    # ----- bookkeeping ----------------------------------------------------------------------------
    def _sample(self) -> int:
        tensors = [c for h in (self.old, self.out) for b in h.buffers.values() for c in b.comps]
        live = storage_bytes(tensors + self.resident + self._staging)
        self.measured.peak_bytes = max(self.measured.peak_bytes, live)
        return live

    def _timed(self, phase: str, t0: float) -> float:
        now = time.perf_counter()
        self.measured.seconds[phase] = self.measured.seconds.get(phase, 0.0) + now - t0
        return now

    def _inject(self, phase: str) -> None:
        if self.faults is None:
            return
        try:
            self.faults.at(f"{self.fault_scope}.{phase}")
        except InjectedFault as err:
            raise TransitionExecutionError(f"rank {self.me}: {err}") from None

    # ----- phases ---------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Hand kept buffers over and check every piece this rank touches resolves to a buffer."""
        if self.graph.detours:
            raise TransitionExecutionError("memory detours through host memory are not executed yet: the graph "
                                           f"needs {len(self.graph.detours)}")
        for step in self._mine(Keep):
            for part in _data_parts(step):
                for p in part.pieces:
                    for name in self.graph.groups[p.group].names:
                        key = (part.model, part.state, name, p.boxes)
                        if key not in self.new.needs:
                            raise TransitionExecutionError(f"rank {self.me}: the graph keeps {key}, which the "
                                                           "new layout does not place here")
                        src = self.old.get(key)
                        self.out.buffers[key] = Buffer(src.boxes, src.comps, written=src.numel)
                        self.measured.bytes_kept += sum(c.nbytes for c in src.comps)
        for step in self._mine(Copy):
            for part in _data_parts(step):
                for p in part.pieces:
                    for name in self.graph.groups[p.group].names:
                        self._check_dest((part.model, part.state, name, p.dest))
                        for box in p.piece:
                            self.old.find(part.model, part.state, name, box)
        for rnd in self.rounds:
            for t in rnd:
                for e in t.entries:
                    if t.src == self.me:
                        self.old.find(e.model, e.state, e.tensor, e.box)
                    if t.dst == self.me:
                        self._check_dest(e.dest_key)
        self._inject("prepare")

    def _mine(self, kind: type[Step]) -> list:
        """This rank's steps of one kind (a keep or copy step acts on one device)."""
        return [s for s in self.graph.steps if isinstance(s, kind) and s.device == self.me]

    def _check_dest(self, key: BufferKey) -> None:
        if key not in self.new.needs:
            raise TransitionExecutionError(f"rank {self.me}: the graph writes {key}, which the new layout does not "
                                           "place here")

    def allocate(self) -> None:
        for key, dtypes in self.new.needs.items():
            if key not in self.out.buffers:
                n = sum(box_volume(b) for b in key[3])
                self.out.buffers[key] = Buffer(key[3], tuple(torch.empty(n, dtype=d, device=self.new.device)
                                                             for d in dtypes))
        self._sample()

    def local_copies(self) -> None:
        """The graph's ``copy`` ops of this rank (run while the first transfers are in flight)."""
        t0 = time.perf_counter()
        for step in self._mine(Copy):
            for part in _data_parts(step):
                for p in part.pieces:
                    for name in self.graph.groups[p.group].names:
                        buf = self.out.get((part.model, part.state, name, p.dest))
                        for box in p.piece:
                            for d, s in zip(buf.view(box), self.old.find(part.model, part.state, name, box),
                                            strict=True):
                                d.copy_(s)
                                self.measured.bytes_copied += s.nbytes
                            buf.written += box_volume(box)
        self._timed("copy", t0)

    def _bytes(self, entry: Entry) -> int:
        return element_bytes(self.dtypes, entry.model, entry.state) * box_volume(entry.box)

    def _direct(self, entry: Entry) -> bool:
        """Whether an entry travels as its own messages (one per component), straight out of the old buffer
        and into the new one, rather than packed with the small ones. Both ends decide alike from sizes."""
        return self._bytes(entry) >= DIRECT_BYTES

    def _staging_buffer(self, entries: list[Entry]) -> torch.Tensor:
        """Bytes for packed entries, each starting ``ALIGN``-aligned (both ends size it alike)."""
        return torch.empty(sum(_align(self._bytes(e)) for e in entries), dtype=torch.uint8, device=self.new.device)

    def _pack(self, entries: list[Entry]) -> torch.Tensor:
        flat = self._staging_buffer(entries)
        offset = 0
        for e in entries:
            start = offset
            for src in self.old.find(e.model, e.state, e.tensor, e.box):
                n = src.numel() * src.element_size()
                flat[offset: offset + n].view(src.dtype).view(src.shape).copy_(src)
                offset += n
            offset = start + _align(offset - start)
        return flat

    def _unpack(self, entries: list[Entry], flat: torch.Tensor) -> None:
        offset = 0
        for e in entries:
            start = offset
            buf = self.out.get(e.dest_key)
            for d in buf.view(e.box):
                n = d.numel() * d.element_size()
                d.copy_(flat[offset: offset + n].view(d.dtype).view(d.shape))
                offset += n
            buf.written += box_volume(e.box)
            offset = start + _align(offset - start)

    def _post(self, t: Transfer, ops: list, landing: list) -> None:
        """This rank's messages of one transfer: the packed small entries (tag 0), then each large entry's
        components (tags 1, 2, ...), sent from the old buffers and received into the new ones where
        contiguous (no staging copy), through a temporary otherwise."""
        small = [e for e in t.entries if not self._direct(e)]
        large = [e for e in t.entries if self._direct(e)]
        sending = t.src == self.me
        group, peer = self.comm.transfer, t.dst if sending else t.src
        op = dist.isend if sending else dist.irecv
        if small:
            flat = self._pack(small) if sending else self._staging_buffer(small)
            self._staging.append(flat)
            ops.append(dist.P2POp(op, flat, peer, group=group, tag=0))
            if not sending:
                landing.append((small, flat))
        tag = 1
        for e in large:
            if sending:
                views = self.old.find(e.model, e.state, e.tensor, e.box)
            else:
                views = self.out.get(e.dest_key).view(e.box)
            for v in views:
                wire = v if v.is_contiguous() else (v.contiguous() if sending else torch.empty(v.shape, dtype=v.dtype,
                                                                                               device=v.device))
                if wire is not v:
                    self._staging.append(wire)
                ops.append(dist.P2POp(op, wire, peer, group=group, tag=tag))
                if not sending:
                    landing.append((v, wire))
                tag += 1
            if not sending:
                self.out.get(e.dest_key).written += box_volume(e.box)
        nbytes = sum(self._bytes(e) for e in t.entries)
        if sending:
            self.measured.bytes_sent += nbytes
        else:
            self.measured.bytes_received += nbytes

    def transfer(self) -> None:
        """The rounds of point-to-point transfers; the local copies run once the first round is posted, so
        they overlap with it (the backend moves the bytes on its own threads)."""
        copied = False
        for rnd in self.rounds:
            mine = [t for t in rnd if self.me in (t.src, t.dst)]
            if not mine:
                continue
            self._inject("transfer")
            ops, landing = [], []
            for t in mine:
                self._post(t, ops, landing)
            self._sample()
            works = dist.batch_isend_irecv(ops)
            if not copied:
                self.local_copies()
                copied = True
            self.comm.wait(works)
            for dest, got in landing:
                if isinstance(dest, list):
                    self._unpack(dest, got)
                elif got is not dest:
                    dest.copy_(got)
            self._staging.clear()
            self.measured.rounds += 1
        if not copied:
            self.local_copies()

    def check_written(self) -> None:
        for key, buf in self.out.buffers.items():
            if buf.written != buf.numel:
                raise TransitionExecutionError(f"rank {self.me}: {key} got {buf.written} of {buf.numel} elements")

    # ----- the whole transition -------------------------------------------------------------------
    def run(self, install):
        """Prepare, vote, move, check, ``install(new_holdings)``, vote to commit. Returns install's result."""
        m = self.measured
        m.start_bytes = self._sample()
        t0 = time.perf_counter()
        err = ""
        try:
            self.prepare()
        except Exception as exc:  # noqa: BLE001 - any failure must reach the vote, not hang the others
            err = f"{type(exc).__name__}: {exc}"
        t0 = self._timed("prepare", t0)
        m.error = self.comm.vote(err)
        if m.error:
            self.out = Holdings()
            raise TransitionExecutionError(f"transition aborted before any transfer: {m.error}")
        result = None
        try:
            self.allocate()
            self.transfer()  # the local copies run inside, overlapped with the first round
            self.check_written()
        except Exception as exc:  # noqa: BLE001
            err = f"{type(exc).__name__}: {exc}"
        t0 = self._timed("move", t0)
        self._staging.clear()
        # every rank has its new buffers before anyone installs: installing talks over the new groups
        m.error = self.comm.vote(err)
        t0 = self._timed("data_vote", t0)
        if m.error:
            self.out = Holdings()
            raise TransitionExecutionError(f"transition rolled back, the old layout stays: {m.error}")
        try:
            result = install(self.out)
            self._inject("install")
        except Exception as exc:  # noqa: BLE001
            err = f"{type(exc).__name__}: {exc}"
        t0 = self._timed("install", t0)
        self._staging.clear()
        m.error = self.comm.vote(err)
        self._timed("commit_vote", t0)
        if m.error:
            self.out = Holdings()
            raise TransitionExecutionError(f"transition rolled back, the old layout stays: {m.error}")
        return result

    def finish(self) -> None:
        """After commit, once the caller dropped the old layout: the resident bytes now."""
        self.old = Holdings()
        self.measured.end_bytes = self._sample()


def new_tensor(buf: Buffer, box: Box) -> torch.Tensor:
    """A weight buffer's data shaped as its (single) box."""
    return buf.comps[0].view(extent(box))
