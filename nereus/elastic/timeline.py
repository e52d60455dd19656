"""The schedule as Chrome/Perfetto trace JSON: one process per device with one track per link port, its
buffer operations and a memory counter; a control process carries process-group creation and the commit
point. Open in https://ui.perfetto.dev or chrome://tracing."""

from __future__ import annotations

import json
from pathlib import Path

from nereus.elastic.graph import Op, TransitionGraph
from nereus.elastic.schedule import PORTS, Schedule, memory_effects

TRACK_NAMES = {"nvlink_out": "NVLink out", "nvlink_in": "NVLink in", "ib_out": "InfiniBand out",
               "ib_in": "InfiniBand in", "pcie_out": "PCIe to host", "pcie_in": "PCIe from host",
               "copy": "local copy"}
BUFFERS_TID = len(PORTS)  # allocations, frees, keeps: zero-time marks on their own track


def _tracks(op: Op, gpn: int) -> list[tuple[int, int, str]]:
    """(pid, tid, label) of every track an op appears on."""
    k = PORTS.index
    if op.kind == "send":
        same = op.device // gpn == op.peer // gpn
        if op.from_host and same:
            return [(op.peer, k("pcie_in"), f"from host of GPU {op.device}")]
        out, inn = ("nvlink_out", "nvlink_in") if same else ("ib_out", "ib_in")
        src = "host of GPU" if op.from_host else "GPU"
        return [(op.device, k(out), f"to GPU {op.peer}"), (op.peer, k(inn), f"from {src} {op.device}")]
    if op.kind == "copy":
        return [(op.device, k("pcie_in") if op.from_host else k("copy"), "copy from host" if op.from_host else "copy")]
    if op.kind == "offload":
        return [(op.device, k("pcie_out"), "offload to host")]
    if op.kind in ("alloc", "alloc_grads", "free", "free_early", "keep", "drop_host"):
        return [(op.device, BUFFERS_TID, op.kind)]
    return []


def _metadata(graph: TransitionGraph, control: int) -> list[dict]:
    events = [{"name": "process_name", "ph": "M", "pid": control, "args": {"name": "transition control"}},
              {"name": "process_sort_index", "ph": "M", "pid": control, "args": {"sort_index": -1}}]
    for d in range(graph.num_gpus):
        events.append({"name": "process_name", "ph": "M", "pid": d,
                       "args": {"name": f"GPU {d} (node {d // graph.gpus_per_node})"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": d, "args": {"sort_index": d}})
        for tid, port in enumerate(PORTS):
            events.append({"name": "thread_name", "ph": "M", "pid": d, "tid": tid,
                           "args": {"name": TRACK_NAMES[port]}})
        events.append({"name": "thread_name", "ph": "M", "pid": d, "tid": BUFFERS_TID, "args": {"name": "buffers"}})
    return events


def _memory_counters(graph: TransitionGraph, sched: Schedule) -> list[dict]:
    """Per device memory in use, replayed in the order the scheduler applied starts and ends."""
    steps = []
    for op in graph.ops:
        start, end = memory_effects(op)
        if start:
            steps.append((sched.start_seq[op.id], sched.start[op.id], start))
        if end:
            steps.append((sched.end_seq[op.id], sched.end[op.id], end))
    steps.sort()
    used = list(graph.old_bytes)
    events = [{"name": "memory GB", "ph": "C", "ts": 0, "pid": d, "args": {"GB": used[d] / 1e9}}
              for d in range(graph.num_gpus)]
    for _, t, effects in steps:
        for d, x in effects:
            used[d] += x
            events.append({"name": "memory GB", "ph": "C", "ts": t * 1e6, "pid": d, "args": {"GB": used[d] / 1e9}})
    return events


def chrome_trace(graph: TransitionGraph, sched: Schedule) -> dict:
    control = graph.num_gpus
    events = _metadata(graph, control)
    for op in graph.ops:
        ts, dur = sched.start[op.id] * 1e6, (sched.end[op.id] - sched.start[op.id]) * 1e6
        args = {"op": op.id, "bytes": op.bytes}
        if op.model:
            args.update(model=op.model, state=op.state)
        if op.kind == "send":
            args["chunks"] = op.chunks
        if op.kind == "commit":
            events.append({"name": "commit", "ph": "i", "s": "g", "ts": ts, "pid": control, "tid": 0})
            continue
        if op.kind == "group":
            events.append({"name": f"create groups: {op.detail}", "ph": "X", "ts": ts, "dur": dur, "pid": control,
                           "tid": 1, "args": args})
            continue
        for pid, tid, label in _tracks(op, graph.gpus_per_node):
            events.append({"name": f"{label} {op.bytes / 1e9:.3g} GB" if op.bytes else label, "ph": "X",
                           "ts": ts, "dur": dur, "pid": pid, "tid": tid, "args": args})
    events += _memory_counters(graph, sched)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(path: str | Path, graph: TransitionGraph, sched: Schedule) -> None:
    Path(path).write_text(json.dumps(chrome_trace(graph, sched)))
