"""Choose the source device of every piece a device must receive.

Pieces already on the destination device never get here (``geometry`` keeps or copies them locally).
For the rest: a holder on the destination's node first (NVLink is ~9× an InfiniBand NIC on H100 nodes,
nereus/spec/hardware.csv), else any holder; among equals the least-loaded sender's link gets the piece.
Once the NVLink ports of a node-local transfer are so loaded that an off-node holder over InfiniBand
would finish the piece sooner (counting both ends' queued bytes), the piece spills to InfiniBand: the
two links of a device then work in parallel, as the bandwidth bound assumes.
The pieces are assigned as a whole to the least-loaded candidate: pieces with the fewest holders first
(their load is forced; the rest must steer around it), larger pieces first among equals (the LPT rule
for min-max load, Graham 1969, "Bounds on multiprocessing timing anomalies"), so load spreads across
source replicas instead of piling onto the first holder found.
Holders whose old buffers were moved to host memory to make room (a memory detour) are used only when
no holder on a GPU remains. A destination keeps drawing from a source it already uses while that source
is within ``affinity_bytes`` (one transfer chunk) of the least-loaded candidate, so small pieces coalesce
into few messages per peer pair while large ones still go where the load is lowest.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
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
    def __init__(self, gpus_per_node: int, candidates: Callable[[SourceKey, str, str], list[int]],
                 offloaded: set[tuple[int, str, str]], num_gpus: int,
                 affinity_bytes: int, nvlink_bytes_per_s: float, ib_bytes_per_s: float):
        """``candidates(key, model, state)`` lists the devices holding a key's cells in the old plan."""
        self.gpn = gpus_per_node
        self.affinity = affinity_bytes
        self.candidates = candidates
        self.offloaded = offloaded
        self.nv, self.ib = nvlink_bytes_per_s, ib_bytes_per_s
        self.nv_out = [0] * num_gpus
        self.ib_out = [0] * num_gpus
        self.nv_in = [0] * num_gpus
        self.ib_in = [0] * num_gpus
        self.used: dict[int, set[int]] = {}  # destination → sources it draws from

    def _pick(self, need: Need, cands: list[int], load: list[int]) -> int:
        """Least-loaded candidate, or one the destination already draws from if nearly as lightly loaded."""
        best = min(cands, key=lambda c: (load[c], c))
        used = self.used.get(need.dst, ())
        near = [c for c in cands if c in used and load[c] - load[best] <= self.affinity]
        return min(near, key=lambda c: (load[c], c)) if near else best

    def _far(self, need: Need, heap: list[list[int]], members: set[int]) -> int:
        """The least NIC-loaded holder off the destination's node, or -1 (lazy heap: loads only grow, a
        stale entry is refreshed when it reaches the top; node-mates are set aside and put back)."""
        node = need.dst // self.gpn
        aside, c = [], -1
        while heap:
            load, d = heap[0]
            if load != self.ib_out[d]:
                heapq.heapreplace(heap, [self.ib_out[d], d])
            elif d // self.gpn == node:
                aside.append(heapq.heappop(heap))
            else:
                c = d
                break
        for entry in aside:
            heapq.heappush(heap, entry)
        used = [u for u in self.used.get(need.dst, ()) if u in members and u // self.gpn != node]
        mate = min(used, key=lambda u: (self.ib_out[u], u)) if used else -1
        if mate >= 0 and (c < 0 or self.ib_out[mate] - self.ib_out[c] <= self.affinity):
            return mate
        return c

    def _assign_key(self, k: tuple, needs: list[Need], out: list[Choice]) -> None:
        cands = self.candidates(*k)
        model, state = k[1], k[2]
        if self.offloaded:
            on_gpu = [c for c in cands if (c, model, state) not in self.offloaded]
            on_host = [c for c in cands if (c, model, state) in self.offloaded]
        else:
            on_gpu, on_host = cands, []
        by_node: dict[int, list[int]] = {}
        for c in on_gpu:
            by_node.setdefault(c // self.gpn, []).append(c)
        heap = [[self.ib_out[c], c] for c in on_gpu]
        heapq.heapify(heap)
        members = set(on_gpu)
        for need in sorted(needs, key=lambda n: (-n.bytes, n.dst)):
            near = [c for c in by_node.get(need.dst // self.gpn, ()) if c != need.dst]
            src = self._pick(need, near, self.nv_out) if near else -1
            b = need.bytes
            far = -1
            if heap and len(near) < len(members):
                t_near = max(self.nv_out[src] + b, self.nv_in[need.dst] + b) / self.nv if src >= 0 else 0.0
                # An off-node holder can only win if the destination's NIC alone beats the NVLink queue.
                if src < 0 or (self.ib_in[need.dst] + b) / self.ib < t_near:
                    far = self._far(need, heap, members)
                if src >= 0 and far >= 0 and max(self.ib_out[far] + b, self.ib_in[need.dst] + b) / self.ib >= t_near:
                    far = -1  # NVLink finishes no later: stay on the node
                if far >= 0:
                    src = -1
            if src >= 0:
                self.nv_out[src] += b
                self.nv_in[need.dst] += b
                out.append(self._chosen(need, src, False))
            elif far >= 0:
                self.ib_out[far] += b
                self.ib_in[need.dst] += b
                heapq.heappush(heap, [self.ib_out[far], far])  # its older entry is now stale
                out.append(self._chosen(need, far, False))
            else:
                out.append(self._from_host(need, on_host))

    def _from_host(self, need: Need, hosts: list[int]) -> Choice:
        hosts = [c for c in hosts if c != need.dst]
        if not hosts:
            raise ValueError(f"no holder for a piece of {need.model} {need.state} needed by GPU {need.dst}")
        node = need.dst // self.gpn
        same = [c for c in hosts if c // self.gpn == node]
        src = min(same or hosts, key=lambda c: (self.ib_out[c], c))
        if not same:
            self.ib_out[src] += need.bytes
        return self._chosen(need, src, True)

    def _chosen(self, need: Need, src: int, from_host: bool) -> Choice:
        self.used.setdefault(need.dst, set()).add(src)
        return Choice(need, src, from_host)

    def assign(self, needs: list[Need]) -> list[Choice]:
        """Key by key: the least flexible first (fewest holders: their load is forced, so the others must
        steer clear of those devices), then the largest; inside a key the largest piece first."""
        by_key: dict[tuple, list[Need]] = {}
        for n in needs:
            by_key.setdefault((n.key, n.model, n.state), []).append(n)
        order = sorted(by_key, key=lambda k: (len(self.candidates(*k)), -sum(n.bytes for n in by_key[k])))
        out: list[Choice] = []
        for k in order:
            self._assign_key(k, by_key[k], out)
        return out
