"""The transitions other systems would run, costed in the same cluster model as the graph.

Each baseline moves the model states the transition changes (a state whose every buffer is kept in place
is left alone by all of them, which favours the baselines) and ignores memory limits (favouring them
again):

* ``checkpoint``: save every changed state once to shared storage, then every device loads its new
  shards back with resharding (Tenplex, Wagenländer et al. SOSP 2024, and torch.distributed.checkpoint's
  resharded load work this way). Storage bandwidth is a parameter, per node, in each direction; saving
  is spread over every node holding the state, loading is per node.
* ``gather_scatter``: one rank per model state gathers a full copy, then sends every device its new
  shards (what a single-controller reshard does without peer-to-peer routing). The rank receives over
  its NVLink and NIC at once, as if its node-mates held a replica's share (generous), then sends; each
  message to or from it pays one link latency, as the transition's chunks do.
* ``broadcast``: per-tensor broadcast from one source replica (OpenRLHF's weight sync to its vLLM
  engines): each tensor in turn goes in full to every device that needs any part of it over a
  pipelined ring (bandwidth-optimal: each link carries the tensor once, Thakur et al. 2005), at the
  NIC rate when the receivers span nodes.
"""

from __future__ import annotations

import math
from collections import defaultdict

from nereus.elastic.links import Links
from nereus.elastic.plan import TransitionPlan

DEFAULT_STORAGE_BYTES_PER_S = 2e9  # per node: shared-storage checkpointing (Tenplex reports similar NFS rates)


def _changed(graph: TransitionPlan) -> dict[str, list[tuple[int, int, int, int]]]:
    """Changed data-carrying model states → (device, old, new, kept) of each of their bundles."""
    per: dict[str, list[tuple[int, int, int, int]]] = defaultdict(list)
    for b in graph.bundles:
        key = f"{b.model}/{b.state}"
        if key in graph.state_bytes:
            per[key].append((b.device, b.old, b.new, b.kept))
    return {k: v for k, v in per.items() if any(old != kept or new != kept for _, old, new, kept in v)}


def checkpoint_time(graph: TransitionPlan, storage_bytes_per_s: float = DEFAULT_STORAGE_BYTES_PER_S) -> float:
    gpn = graph.gpus_per_node
    changed = _changed(graph)
    write_nodes = {g // gpn for rows in changed.values() for g, old, _, _ in rows if old}
    written = sum(graph.state_bytes[k].bytes for k in changed)
    read_per_node: dict[int, int] = defaultdict(int)
    for rows in changed.values():
        for g, _, new, _ in rows:
            read_per_node[g // gpn] += new
    save = written / (max(1, len(write_nodes)) * storage_bytes_per_s)
    load = max(read_per_node.values(), default=0) / storage_bytes_per_s
    return save + load


def gather_scatter_time(graph: TransitionPlan, links: Links) -> float:
    """Roots on distinct devices (the lowest old holder not yet a root) work in parallel; each root's
    model states go one after the other, gather then scatter."""
    gpn = graph.gpus_per_node
    roots: dict[int, float] = defaultdict(float)
    for key, rows in sorted(_changed(graph).items()):
        holders = sorted(g for g, old, _, _ in rows if old)
        root = next((g for g in holders if g not in roots), holders[0])
        full = graph.state_bytes[key].bytes
        node = root // gpn
        holders = {g for g, old, _, _ in rows if old and g != root}
        sent = [(g, new - kept) for g, _, new, kept in rows if g != root and new > kept]
        multi_node = any(g // gpn != node for g in holders | {g for g, _ in sent})
        latency = links.inter_latency_s if multi_node else links.intra_latency_s
        gather = full / (links.ib + links.nvlink) + len(holders) * latency  # one message per holder
        total = sum(b for _, b in sent)
        far = sum(b for g, b in sent if g // gpn != node)
        scatter = max(far / links.ib, total / (links.ib + links.nvlink)) + len(sent) * latency
        roots[root] += gather + scatter
    return max(roots.values(), default=0.0)


def broadcast_time(graph: TransitionPlan, links: Links) -> float:
    gpn = graph.gpus_per_node
    total = 0.0
    for key, rows in _changed(graph).items():
        size = graph.state_bytes[key]
        receivers = {g for g, _, new, kept in rows if new > kept}
        nodes = {g // gpn for g, old, _, _ in rows if old or g in receivers}
        if not receivers:
            continue
        rate, lat = (links.ib, links.inter_latency_s) if len(nodes) > 1 else (links.nvlink, links.intra_latency_s)
        steps = math.ceil(math.log2(len(receivers) + 1))
        total += size.bytes / rate + size.tensors * steps * lat
    return total


def baseline_times(graph: TransitionPlan, links: Links,
                   storage_bytes_per_s: float = DEFAULT_STORAGE_BYTES_PER_S) -> dict[str, float]:
    return {"checkpoint": checkpoint_time(graph, storage_bytes_per_s),
            "gather_scatter": gather_scatter_time(graph, links),
            "broadcast": broadcast_time(graph, links)}
