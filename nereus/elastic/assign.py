"""Choose the source device of every piece a device must receive.

Pieces already on the destination device never get here (``geometry`` keeps or copies them locally).
For the rest: a holder on the destination's node first (NVLink is ~9× an InfiniBand NIC on H100 nodes,
shared/data/hardware.csv), else any holder; among equals the least-loaded sender's link gets the piece.
The pieces are assigned as a whole, largest first, to the least-loaded candidate (the LPT rule for
min-max load, Graham 1969, "Bounds on multiprocessing timing anomalies": within 4/3 of the optimal
maximum load), so load spreads across source replicas instead of piling onto the first holder found.
Holders whose old buffers were moved to host memory to make room (a memory detour) are used only when
no holder on a GPU remains. A destination keeps drawing from a source it already uses while that source
is within one piece of the least-loaded candidate, so pieces coalesce into few messages per peer pair.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from nereus.elastic.geometry import SourceKey


@dataclass
class Need:
    """Bytes one device must receive for one model state from any device of a source key."""

    dst: int
    model: str
    state: str
    key: SourceKey
    pieces: tuple
    bytes: int


@dataclass(frozen=True)
class Choice:
    need: Need
    src: int
    from_host: bool


class Assigner:
    def __init__(self, gpus_per_node: int, candidates, offloaded: set[tuple[int, str, str]], num_gpus: int):
        """``candidates(key, model, state)`` lists the devices holding a key's cells in the old plan."""
        self.gpn = gpus_per_node
        self.candidates = candidates
        self.offloaded = offloaded
        self.nv_out = [0] * num_gpus
        self.ib_out = [0] * num_gpus
        self._by_node: dict[tuple, dict[int, list[int]]] = {}
        self._heaps: dict[tuple, list[list[int]]] = {}
        self._host: dict[tuple, list[int]] = {}
        self._members: dict[tuple, set[int]] = {}
        self.used: dict[int, set[int]] = {}  # destination → sources it draws from

    def _split(self, key: SourceKey, model: str, state: str) -> tuple:
        k = (key, model, state)
        if k not in self._by_node:
            on_gpu, on_host = [], []
            for c in self.candidates(key, model, state):
                (on_host if (c, model, state) in self.offloaded else on_gpu).append(c)
            by_node: dict[int, list[int]] = {}
            for c in on_gpu:
                by_node.setdefault(c // self.gpn, []).append(c)
            self._by_node[k] = by_node
            self._heaps[k] = [[self.ib_out[c], c] for c in on_gpu]
            heapq.heapify(self._heaps[k])
            self._members[k] = set(on_gpu)
            self._host[k] = on_host
        return k

    def _pick(self, need: Need, cands: list[int], load: list[int]) -> int:
        """Least-loaded candidate, or one the destination already draws from if within one piece of it."""
        best = min(cands, key=lambda c: (load[c], c))
        used = self.used.get(need.dst, ())
        near = [c for c in cands if c in used and load[c] - load[best] <= need.bytes]
        return min(near, key=lambda c: (load[c], c)) if near else best

    def choose(self, need: Need) -> Choice:
        k = self._split(need.key, need.model, need.state)
        node = need.dst // self.gpn
        near = [c for c in self._by_node[k].get(node, ()) if c != need.dst]
        if near:
            src = self._pick(need, near, self.nv_out)
            self.nv_out[src] += need.bytes
            return self._chosen(need, src, False)
        used = [c for c in self.used.get(need.dst, ()) if c in self._members[k]]
        heap = self._heaps[k]
        while heap:
            load, c = heap[0]
            if load != self.ib_out[c]:  # stale entry: another key loaded this device since
                heapq.heapreplace(heap, [self.ib_out[c], c])
                continue
            mate = min(used, key=lambda u: (self.ib_out[u], u)) if used else -1
            if mate >= 0 and mate != c and self.ib_out[mate] - load <= need.bytes:
                self.ib_out[mate] += need.bytes
                heapq.heappush(heap, [self.ib_out[mate], mate])  # its older entry is now stale
                return self._chosen(need, mate, False)
            self.ib_out[c] += need.bytes
            heapq.heapreplace(heap, [self.ib_out[c], c])
            return self._chosen(need, c, False)
        hosts = [c for c in self._host[k] if c != need.dst]
        if not hosts:
            raise ValueError(f"no holder for a piece of {need.model} {need.state} needed by GPU {need.dst}")
        same = [c for c in hosts if c // self.gpn == node]
        src = min(same or hosts, key=lambda c: (self.ib_out[c], c))
        if not same:
            self.ib_out[src] += need.bytes
        return self._chosen(need, src, True)

    def _chosen(self, need: Need, src: int, from_host: bool) -> Choice:
        self.used.setdefault(need.dst, set()).add(src)
        return Choice(need, src, from_host)

    def assign(self, needs: list[Need]) -> list[Choice]:
        return [self.choose(n) for n in sorted(needs, key=lambda n: (-n.bytes, n.dst))]
