"""Plan a transition end to end: graph, schedule, bounds, baselines — what ``nereus transition`` prints
and what the controller and simulator call for the cost of moving from one plan to another."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from nereus.cost.hardware import Hardware
from nereus.elastic.baselines import DEFAULT_STORAGE_BYTES_PER_S, baseline_times
from nereus.elastic.graph import TransitionOptions, build_graph
from nereus.elastic.links import Links
from nereus.elastic.plan import Copy, Detour, Keep, TransitionPlan
from nereus.elastic.schedule import Schedule, schedule_graph
from nereus.spec.errors import SpecError
from nereus.spec.job import JobSpec
from nereus.spec.layout import Placement, Plan


def bandwidth_bound(graph: TransitionPlan, links: Links) -> float:
    """Seconds no schedule of direct transfers (no store-and-forward relays) can beat.

    Per device: what it must receive, over its NIC when no node-mate holds it, else over NVLink and NIC
    together; and its local re-slicing at HBM speed. Per set of old holders: the bytes only they hold
    must leave through their own links, over the NICs for receivers on nodes where none of them sits.
    """
    both = links.ib + links.nvlink
    best = 0.0
    bw = graph.bandwidth
    for d in range(graph.num_gpus):
        best = max(best, bw.recv_far_bytes[d] / links.ib, bw.recv_bytes[d] / both,
                   2 * bw.local_copy_bytes[d] / links.hbm)
    for s in bw.source_sets:
        best = max(best, s.far_bytes / (s.devices * links.ib), s.bytes / (s.devices * both))
    return best


@dataclass
class TransitionReport:
    predicted_s: float
    bandwidth_bound_s: float
    commit_s: float
    bytes_sent: int
    lower_bound_bytes: int
    bytes_kept: int
    bytes_copied: int
    detour_bytes: int
    detours: tuple[Detour, ...]
    ops: dict[str, int]
    peak_bytes: list[int]
    capacity_bytes: float
    baselines_s: dict[str, float]
    storage_bytes_per_s: float
    build_s: float
    schedule_s: float
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        peak_dev = max(range(len(self.peak_bytes)), key=self.peak_bytes.__getitem__) if self.peak_bytes else -1
        return {
            "predicted_s": self.predicted_s, "bandwidth_bound_s": self.bandwidth_bound_s, "commit_s": self.commit_s,
            "bytes_sent": self.bytes_sent, "lower_bound_bytes": self.lower_bound_bytes,
            "bytes_kept": self.bytes_kept, "bytes_copied_locally": self.bytes_copied,
            "detour_bytes": self.detour_bytes, "detours": [d.to_json() for d in self.detours], "ops": self.ops,
            "peak_bytes_max": max(self.peak_bytes, default=0), "peak_device": peak_dev,
            "peak_bytes_per_device": self.peak_bytes, "capacity_bytes": self.capacity_bytes,
            "baselines_s": self.baselines_s,
            "baseline_ratios": {k: v / self.predicted_s if self.predicted_s else None
                                for k, v in self.baselines_s.items()},
            "storage_bytes_per_s_per_node": self.storage_bytes_per_s,
            "build_s": self.build_s, "schedule_s": self.schedule_s, "notes": self.notes,
        }

    def text(self) -> str:
        gb = 1e9
        peak = max(self.peak_bytes, default=0)
        dev = self.peak_bytes.index(peak) if self.peak_bytes else -1
        ratio = self.predicted_s / self.bandwidth_bound_s if self.bandwidth_bound_s else 1.0
        lines = [
            f"predicted {_secs(self.predicted_s)}  (bandwidth bound {_secs(self.bandwidth_bound_s)}, "
            f"{ratio:.2f}x; commit at {_secs(self.commit_s)})",
            f"bytes sent {self.bytes_sent / gb:.2f} GB {'=' if self.bytes_sent == self.lower_bound_bytes else '>'} "
            f"owner-change lower bound {self.lower_bound_bytes / gb:.2f} GB; kept in place "
            f"{self.bytes_kept / gb:.2f} GB, re-sliced locally {self.bytes_copied / gb:.2f} GB",
            f"peak memory {peak / gb:.2f} GB on GPU {dev} (usable {self.capacity_bytes / gb:.2f} GB)",
            "operations: " + ", ".join(f"{k} {v}" for k, v in sorted(self.ops.items())),
        ]
        if self.detours:
            lines.append(f"memory detours: {len(self.detours)} buffers through host memory, "
                         f"{self.detour_bytes / gb:.2f} GB over PCIe (old and new state do not fit together)")
        lines.append(f"baselines (x slower than this transition; storage {self.storage_bytes_per_s / gb:g} GB/s/node):")
        for name, t in self.baselines_s.items():
            times = t / self.predicted_s if self.predicted_s else float("inf")
            lines.append(f"  {name:<15} {_secs(t):>10}  {times:8.1f}x")
        lines.append(f"graph built in {self.build_s:.2f} s, scheduled in {self.schedule_s:.2f} s")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _secs(t: float) -> str:
    return f"{t * 1e3:.2f} ms" if t < 1 else f"{t:.3f} s"


@contextmanager
def no_cyclic_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector: building a graph allocates ~10⁵ small acyclic tuples,
    and the collector's passes over them cost ~30% of the build (measured on the 1,024-GPU benchmark).
    Reference counting still frees everything; the collector resumes afterwards."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass
class Transition:
    graph: TransitionPlan
    schedule: Schedule
    report: TransitionReport


def plan_transition(job: JobSpec, old: Plan, new: Plan, hw: Hardware | None = None,
                    options: TransitionOptions | None = None,
                    storage_bytes_per_s: float = DEFAULT_STORAGE_BYTES_PER_S) -> Transition:
    """Build and schedule the transition from ``old`` to ``new``; report its cost and the baselines'."""
    hw = hw or Hardware(job.cluster)
    with no_cyclic_gc():
        t0 = time.perf_counter()
        graph = build_graph(job, old, new, hw, options)
        t1 = time.perf_counter()
        sched = schedule_graph(graph, hw)
        t2 = time.perf_counter()
    links = Links.of(hw)
    kept = sum(s.bytes for s in graph.steps if isinstance(s, Keep))
    copied = sum(s.bytes for s in graph.steps if isinstance(s, Copy))
    notes = []
    if graph.group_setup_s == 0 and graph.count().get("group"):
        notes.append("process groups of the new layouts are created ahead of the move (not in the time)")
    report = TransitionReport(sched.makespan_s, bandwidth_bound(graph, links), sched.commit_s, graph.bytes_sent,
                              graph.lower_bound_bytes, kept, copied, graph.detour_bytes, graph.detours,
                              graph.count(), sched.peak_bytes, graph.capacity_bytes,
                              baseline_times(graph, links, storage_bytes_per_s), storage_bytes_per_s,
                              t1 - t0, t2 - t1, notes)
    return Transition(graph, sched, report)


def check_job_plans(job: JobSpec, old: Plan, new: Plan) -> JobSpec:
    """Both plans must place exactly the job's model-stages; the job's cluster grows (same node shape)
    to the larger plan when a plan spans more GPUs than the spec's cluster."""
    need = {str(ms) for ms in job.model_stages()}
    for flag, plan in (("--from", old), ("--to", new)):
        have = {str(p.model_stage) for p in plan.placements}
        if need - have:
            raise SpecError(f"{flag} plan.placements", f"missing model-stages {sorted(need - have)} of job "
                                                      f"{job.name!r}")
        if have - need:
            raise SpecError(f"{flag} plan.placements", f"{sorted(have - need)} are not model-stages of job "
                                                      f"{job.name!r}")
    n = max(old.num_gpus, new.num_gpus)
    if n > job.cluster.num_gpus:
        gpn = job.cluster.gpus_per_node
        if n % gpn:
            raise SpecError("--to plan.num_gpus", f"{n} GPUs is not a whole number of {gpn}-GPU nodes")
        job = job.with_gpus(n)
    return job


def change_lines(old: Plan, new: Plan) -> list[str]:
    """One line per model-stage: its layout and GPUs before and after."""
    def where(p: Placement) -> str:
        g = p.gpus
        span = f"{g[0]}-{g[-1]}" if list(g) == list(range(g[0], g[-1] + 1)) else f"{len(g)} GPUs"
        return f"{p.layout.short()} on {span}"

    lines = []
    before = {p.model_stage: p for p in old.placements}
    after = {p.model_stage: p for p in new.placements}
    for ms in sorted(set(before) | set(after)):
        a, b = before.get(ms), after.get(ms)
        if a and b and (a.layout, a.gpus) == (b.layout, b.gpus):
            lines.append(f"  {str(ms):<22} {where(a)}  (unchanged)")
        else:
            lines.append(f"  {str(ms):<22} {where(a) if a else '-'}  ->  {where(b) if b else '-'}")
    return lines
