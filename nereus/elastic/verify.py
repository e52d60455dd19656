"""Check a transition graph and its schedule against the design's invariants 1, 2 and 4.

The checks rebuild what every device holds before and after from the per-tensor EMUs (``emu``, straight
from the sharding contract) rather than from the graph builder's groups, so a grouping or geometry
mistake shows up here. Cost is per tensor and device: meant for tests, the runtime's executor and
small-to-mid jobs (an 8B job on 64 GPUs takes seconds).

1. Every destination buffer is covered exactly once (kept whole, or pieces that are disjoint, inside it
   and adding up to it), from old buffers that hold each piece whole; nothing is sent to a device that
   already holds it; bytes sent equal the owner-change lower bound unless the graph records a detour.
2. At no point of the schedule does any device exceed its usable memory; dependencies and port
   exclusivity hold; the replay ends at the new plan's bytes.
4. The commit point exists; before it no old data buffer is freed unless its bytes were first copied to
   host memory, and nothing writes into a buffer the old layout uses; after it only releases and the
   new gradient buffers.
"""

from __future__ import annotations

from collections import defaultdict

from nereus.cost.hardware import Hardware
from nereus.elastic.boxes import BoxSet, intersect_sets, set_contains, set_volume, subtract
from nereus.elastic.emu import OPTIMIZER, build_emus, grads_kind, weights_kind
from nereus.elastic.links import Links
from nereus.elastic.plan import AllocGrads, Commit, Copy, FreeEarly, Group, Keep, Offload, Send, TransitionPlan
from nereus.elastic.schedule import Schedule, op_timing
from nereus.spec.job import JobSpec
from nereus.spec.layout import Plan

Buffers = dict[tuple[int, str, str, str], set[BoxSet]]  # (device, model, state, tensor) → box sets
EPS = 1e-9


class TransitionInvariantError(AssertionError):
    """A transition graph or schedule breaks an invariant; ``problems`` lists every finding."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        super().__init__(f"{len(problems)} invariant violation(s):\n  {shown}{more}")


def _buffers(job: JobSpec, plan: Plan) -> tuple[Buffers, dict[tuple[int, str, str], int]]:
    bufs: Buffers = defaultdict(set)
    bpe: dict[str, int] = {}
    for emu in build_emus(job, plan):
        for t in emu.tensors:
            bpe[t.state] = t.bytes_per_element
            for s in t.shards:
                bufs[(s.device, emu.model_stage.model, t.state, t.name)].add(s.boxes)
    sizes: dict[tuple[int, str, str], int] = defaultdict(int)
    for (d, m, st, _), sets in bufs.items():
        sizes[(d, m, st)] += sum(set_volume(bs) for bs in sets) * bpe[st]
    return bufs, sizes


def _disjoint_cover(dest: BoxSet, pieces: list[BoxSet]) -> str | None:
    """None when ``pieces`` lie inside ``dest``, are pairwise disjoint and add up to it."""
    for p in pieces:
        if not set_contains(dest, p):
            return f"piece {p} lies outside the buffer {dest}"
    for i, a in enumerate(pieces):
        for b in pieces[i + 1:]:
            if intersect_sets(a, b):
                return f"pieces {a} and {b} overlap (covered twice)"
    got, want = sum(set_volume(p) for p in pieces), set_volume(dest)
    if got != want:
        return f"pieces cover {got} of {want} elements"
    return None


def _missing_locally(dest: BoxSet, olds: set[BoxSet]) -> int:
    """Elements of ``dest`` that no old buffer on the same device holds."""
    region = list(dest)
    for src in olds:
        for box in src:
            region = [p for x in region for p in subtract(x, box)]
    return sum(set_volume((b,)) for b in region)


class _Coverage:
    """Invariant 1, tensor by tensor."""

    def __init__(self, job: JobSpec, old: Plan, new: Plan, graph: TransitionPlan):
        self.graph = graph
        self.old, self.old_sizes = _buffers(job, old)
        self.new, self.new_sizes = _buffers(job, new)
        self.got: dict[tuple, list[BoxSet]] = defaultdict(list)
        self.problems: list[str] = []
        self.bpe = {k.name: k.bytes_per_element for k in (weights_kind(job.options.weight_bytes), OPTIMIZER,
                                                           grads_kind(job.options.grad_bytes))}

    def record(self, op_id: int, device: int, model: str, state: str, group: Group, piece: BoxSet,
               dest: BoxSet,
               source: int | None = None, src_boxes: BoxSet | None = None, write: bool = True) -> int:
        for name in group.names:
            key = (device, model, state, name)
            if dest not in self.new.get(key, ()):
                self.problems.append(f"op {op_id}: GPU {device} {model} {state} {name}: {dest} is not a new buffer")
            if not write and dest not in self.old.get(key, ()):
                self.problems.append(f"op {op_id}: keeps {model} {name} {dest} on GPU {device}, which it never held")
            if write and dest in self.old.get(key, ()):
                self.problems.append(f"op {op_id}: writes into {model} {name} {dest} on GPU {device}, a buffer "
                                     "the old layout still uses")
            self.got[key + (dest,)].append(piece)
            if source is not None:
                olds = self.old.get((source, model, state, name), ())
                if not any(set_contains(o, piece) for o in olds):
                    self.problems.append(f"op {op_id}: GPU {source} holds no old buffer of {name} with {piece}")
                here = self.old.get(key, ())
                if any(intersect_sets(o, piece) for o in here):
                    self.problems.append(f"op {op_id}: sends {name} {piece} to GPU {device}, which already holds it")
            if src_boxes is not None and (src_boxes not in self.old.get(key, ()) or
                                          not set_contains(src_boxes, piece)):
                self.problems.append(f"op {op_id}: local source {src_boxes} of {name} on GPU {device} is not an "
                                     f"old buffer holding {piece}")
        return set_volume(piece) * group.count * self.bpe[state]

    def run(self) -> list[str]:
        groups = self.graph.groups
        for step in self.graph.steps:
            if isinstance(step, Keep):
                for part in step.parts:
                    for p in part.pieces:
                        self.record(step.id, step.device, part.model, part.state, groups[p.group], p.boxes, p.boxes,
                                    write=False)
            elif isinstance(step, Copy):
                for part in step.parts:
                    for p in part.pieces:
                        self.record(step.id, step.device, part.model, part.state, groups[p.group], p.piece, p.dest,
                                    src_boxes=p.source)
            elif isinstance(step, Send):
                nbytes = sum(self.record(step.id, step.dst, part.model, part.state, groups[p.group], p.piece, p.dest,
                                         source=step.src) for part in step.parts for p in part.pieces)
                if nbytes != step.bytes:
                    self.problems.append(f"op {step.id}: send of {step.bytes} bytes carries pieces of {nbytes}")
        self._check_buffers()
        self._check_bytes(self.graph.bytes_sent)
        return self.problems

    def _check_buffers(self) -> None:
        grads = grads_kind(2).name
        allocated = {(s.device, part.model) for s in self.graph.steps if isinstance(s, (AllocGrads, Keep))
                     for part in s.parts if part.state == grads}
        for key, sets in self.new.items():
            d, m, st, name = key
            if st == grads:
                if (d, m) not in allocated:
                    self.problems.append(f"GPU {d}: no gradient buffers allocated or kept for {m}")
                continue
            for dest in sets:
                why = _disjoint_cover(dest, self.got.get(key + (dest,), []))
                if why:
                    self.problems.append(f"GPU {d} {m} {st} {name} {dest}: {why}")

    def _check_bytes(self, sent: int) -> None:
        lower = sum(_missing_locally(dest, self.old.get(key, set())) * self.bpe[key[2]]
                    for key, sets in self.new.items() if key[2] != "grads" for dest in sets)
        if lower != self.graph.lower_bound_bytes:
            self.problems.append(f"owner-change lower bound is {lower} bytes, the graph says "
                                 f"{self.graph.lower_bound_bytes}")
        if sent != lower and not self.graph.detours:
            self.problems.append(f"{sent} bytes sent, but the owner-change lower bound is {lower} and the graph "
                                 "records no detour")
        for d in range(self.graph.num_gpus):
            old = sum(v for (dd, _, _), v in self.old_sizes.items() if dd == d)
            new = sum(v for (dd, _, _), v in self.new_sizes.items() if dd == d)
            if (old, new) != (self.graph.old_bytes[d], self.graph.new_bytes[d]):
                self.problems.append(f"GPU {d}: EMUs hold {old} → {new} bytes, the graph says "
                                     f"{self.graph.old_bytes[d]} → {self.graph.new_bytes[d]}")


def check_commit(graph: TransitionPlan) -> list[str]:
    """Invariant 4: the commit point and what may happen on each side of it."""
    commits = [s for s in graph.steps if isinstance(s, Commit)]
    if len(commits) != 1:
        return [f"expected one commit step, found {[s.id for s in commits]}"]
    commit = commits[0]
    before = set(commit.deps)
    offloads = {s.id: (s.device, part.model, part.state) for s in graph.steps if isinstance(s, Offload)
                for part in s.parts}
    problems = []
    for step in graph.steps:
        if step is commit:
            continue
        after = commit.id in step.deps or any(graph.steps[d].after_commit for d in step.deps)
        if not step.after_commit and step.id not in before:
            problems.append(f"op {step.id} ({step.kind}) runs before the commit but the commit does not wait for it")
        if step.after_commit and (step.id in before or not after):
            problems.append(f"op {step.id} ({step.kind}) does not wait for the commit: before the commit would "
                            "break the old layout")
        if isinstance(step, FreeEarly):
            backed = {offloads.get(d) for d in step.deps}
            for part in step.parts:
                if part.state != "grads" and (step.device, part.model, part.state) not in backed:
                    problems.append(f"op {step.id}: frees {part.model} {part.state} on GPU {step.device} before the "
                                    "commit without a copy in host memory")
    return problems


def check_schedule(graph: TransitionPlan, sched: Schedule, hw: Hardware) -> list[str]:
    """Invariant 2 plus the schedule's own consistency: dependencies, port exclusivity, commit order."""
    problems = []
    links = Links.of(hw)
    per_port: dict[int, list[tuple[float, float, int]]] = defaultdict(list)
    for step in graph.steps:
        s, e = sched.start[step.id], sched.end[step.id]
        if not s <= e:
            problems.append(f"op {step.id}: bad interval [{s}, {e}]")
            continue
        for d in step.deps:
            if s < sched.end[d] - EPS:
                problems.append(f"op {step.id} starts at {s:.6f} s before its dependency {d} ends "
                                f"({sched.end[d]:.6f} s)")
        dur, ports = op_timing(step, links, graph.gpus_per_node, graph.group_setup_s)
        if abs((e - s) - dur) > EPS * max(1.0, dur):
            problems.append(f"op {step.id}: runs {e - s:.6f} s, its cost is {dur:.6f} s")
        for p in ports:
            per_port[p].append((s, e, step.id))
    for p, spans in per_port.items():
        spans.sort()
        for (_, e0, a), (s1, _, b) in zip(spans, spans[1:], strict=False):
            if s1 < e0 - EPS:
                problems.append(f"ops {a} and {b} share port {p} at the same time")
    problems += _replay_memory(graph, sched)
    return problems


def _replay_memory(graph: TransitionPlan, sched: Schedule) -> list[str]:
    steps = []
    for step in graph.steps:
        mem = step.memory()
        steps += [(sched.start_seq[step.id], step.id, e.device, e.bytes) for e in mem.at_start]
        steps += [(sched.end_seq[step.id], step.id, e.device, e.bytes) for e in mem.at_end]
    steps.sort()
    used = list(graph.old_bytes)
    problems, worst = [], {}
    for _, op_id, d, x in steps:
        used[d] += x
        if used[d] > graph.capacity_bytes and d not in worst:
            worst[d] = op_id
            problems.append(f"GPU {d}: {used[d] / 1e9:.3f} GB in use after op {op_id} exceeds the usable "
                            f"{graph.capacity_bytes / 1e9:.3f} GB")
    for d in range(graph.num_gpus):
        if used[d] != graph.new_bytes[d]:
            problems.append(f"GPU {d}: the schedule ends with {used[d]} bytes, the new plan holds {graph.new_bytes[d]}")
    return problems


def verify_transition(job: JobSpec, old: Plan, new: Plan, graph: TransitionPlan, sched: Schedule | None = None,
                      hw: Hardware | None = None) -> list[str]:
    """Every violation of invariants 1, 2 and 4 found (empty: the transition is sound)."""
    problems = _Coverage(job, old, new, graph).run() + check_commit(graph)
    if sched is not None:
        problems += check_schedule(graph, sched, hw or Hardware(job.cluster))
    return problems


def assert_valid(job: JobSpec, old: Plan, new: Plan, graph: TransitionPlan, sched: Schedule | None = None,
                 hw: Hardware | None = None) -> None:
    """Raise ``TransitionInvariantError`` listing every violation, if any."""
    problems = verify_transition(job, old, new, graph, sched, hw)
    if problems:
        raise TransitionInvariantError(problems)
