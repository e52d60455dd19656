"""The schedule as Chrome/Perfetto trace JSON: one process per device with one track per link port, its
buffer operations and a memory counter; a control process carries process-group creation and the commit
point. Open in https://ui.perfetto.dev or chrome://tracing."""

from __future__ import annotations

import json
from pathlib import Path

from nereus.elastic.plan import BufferStep, Commit, Copy, CreateGroups, Offload, Send, Step, TransitionPlan
from nereus.elastic.schedule import PORTS, Schedule

TRACK_NAMES = {"nvlink_out": "NVLink out", "nvlink_in": "NVLink in", "ib_out": "InfiniBand out",
               "ib_in": "InfiniBand in", "pcie_out": "PCIe to host", "pcie_in": "PCIe from host",
               "copy": "local copy"}
BUFFERS_TID = len(PORTS)  # allocations, frees, keeps: zero-time marks on their own track


def _tracks(step: Step, gpn: int) -> list[tuple[int, int, str]]:
    """(pid, tid, label) of every track a step appears on."""
    k = PORTS.index
    if isinstance(step, Send):
        same = step.src // gpn == step.dst // gpn
        if step.from_host and same:
            return [(step.dst, k("pcie_in"), f"from host of GPU {step.src}")]
        out, inn = ("nvlink_out", "nvlink_in") if same else ("ib_out", "ib_in")
        src = "host of GPU" if step.from_host else "GPU"
        return [(step.src, k(out), f"to GPU {step.dst}"), (step.dst, k(inn), f"from {src} {step.src}")]
    if isinstance(step, Copy):
        return [(step.device, k("pcie_in"), "copy from host") if step.from_host else (step.device, k("copy"), "copy")]
    if isinstance(step, Offload):
        return [(step.device, k("pcie_out"), "offload to host")]
    if isinstance(step, BufferStep):  # allocations, keeps, frees: zero-time marks
        return [(step.device, BUFFERS_TID, step.kind)]
    return []


def _metadata(graph: TransitionPlan, control: int) -> list[dict]:
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


def _memory_counters(graph: TransitionPlan, sched: Schedule) -> list[dict]:
    """Per device memory in use, replayed in the order the scheduler applied starts and ends."""
    steps = []
    for step in graph.steps:
        mem = step.memory()
        if mem.at_start:
            steps.append((sched.start_seq[step.id], sched.start[step.id], mem.at_start))
        if mem.at_end:
            steps.append((sched.end_seq[step.id], sched.end[step.id], mem.at_end))
    steps.sort()
    used = list(graph.old_bytes)
    events = [{"name": "memory GB", "ph": "C", "ts": 0, "pid": d, "args": {"GB": used[d] / 1e9}}
              for d in range(graph.num_gpus)]
    for _, t, effects in steps:
        for e in effects:
            used[e.device] += e.bytes
            events.append({"name": "memory GB", "ph": "C", "ts": t * 1e6, "pid": e.device,
                           "args": {"GB": used[e.device] / 1e9}})
    return events


def chrome_trace(graph: TransitionPlan, sched: Schedule) -> dict:
    control = graph.num_gpus
    events = _metadata(graph, control)
    for step in graph.steps:
        ts, dur = sched.start[step.id] * 1e6, (sched.end[step.id] - sched.start[step.id]) * 1e6
        if isinstance(step, Commit):
            events.append({"name": "commit", "ph": "i", "s": "g", "ts": ts, "pid": control, "tid": 0})
            continue
        if isinstance(step, CreateGroups):
            events.append({"name": f"create groups: {step.detail}", "ph": "X", "ts": ts, "dur": dur, "pid": control,
                           "tid": 1, "args": {"op": step.id}})
            continue
        nbytes = getattr(step, "bytes", 0)
        args = {"op": step.id, "bytes": nbytes}
        if isinstance(step, (BufferStep, Send)):
            args.update(model=step.model, state=step.state)
        if isinstance(step, Send):
            args["chunks"] = step.chunks
        for pid, tid, label in _tracks(step, graph.gpus_per_node):
            events.append({"name": f"{label} {nbytes / 1e9:.3g} GB" if nbytes else label, "ph": "X",
                           "ts": ts, "dur": dur, "pid": pid, "tid": tid, "args": args})
    events += _memory_counters(graph, sched)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(path: str | Path, graph: TransitionPlan, sched: Schedule) -> None:
    Path(path).write_text(json.dumps(chrome_trace(graph, sched)))
