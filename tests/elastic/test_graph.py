"""Hand-built transitions: locality, balance, chunking, commit point, memory refusal and detours; and
mutations of a sound graph that ``verify`` must catch."""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import replace

import pytest

from nereus.cost.hardware import Hardware
from nereus.elastic.errors import TransitionMemoryError
from nereus.elastic.graph import TransitionOptions, build_graph
from nereus.elastic.plan import Copy, Send, SentPiece, StatePart
from nereus.elastic.schedule import schedule_graph
from nereus.elastic.verify import TransitionInvariantError, assert_valid, check_commit, verify_transition
from nereus.spec import InfeasibleError, SpecError
from tests.elastic.helpers import brute_force_lower_bound, plan, tiny_job

TRAIN = "actor/training"


def build(job, old, new, **opts):
    hw = Hardware(job.cluster)
    graph = build_graph(job, old, new, hw, TransitionOptions(**opts))
    sched = schedule_graph(graph, hw)
    assert_valid(job, old, new, graph, sched, hw)
    return graph, sched


def sends(graph):
    return [s for s in graph.steps if isinstance(s, Send)]


def test_same_plan_moves_nothing_and_keeps_every_buffer():
    job = tiny_job()
    p = plan([(TRAIN, {"tp": 2, "pp": 2, "dp": 2}, range(8)), ("reward/inference", {"tp": 4, "dp": 2}, range(8))], 8)
    graph, sched = build(job, p, p)
    assert graph.bytes_sent == graph.lower_bound_bytes == 0
    assert set(graph.count()) == {"keep", "commit"}
    assert sum(op.bytes for op in graph.steps if op.kind == "keep") == sum(graph.old_bytes)
    assert sched.makespan_s == 0


def test_tp_change_on_the_same_gpus_reslices_what_is_local():
    """TP 2 → 4: a rank whose new quarter lies inside its old half copies it locally; the others receive
    their quarter from a node-mate (all 8 GPUs are one node: no InfiniBand)."""
    job = tiny_job(nodes=1, gpus_per_node=8)
    old = plan([("actor/inference", {"tp": 2, "dp": 4}, range(8))], 8)
    new = plan([("actor/inference", {"tp": 4, "dp": 2}, range(8))], 8)
    graph, _ = build(job, old, new)
    assert graph.bytes_sent == brute_force_lower_bound(job, old, new) > 0
    copies = {s.device for s in graph.steps if isinstance(s, Copy)}
    assert {0, 4} <= copies  # new TP rank 0 sits on old TP rank 0: its quarter is in its half
    assert all(s.src // 8 == s.dst // 8 for s in sends(graph))


def test_new_replicas_draw_from_their_node_then_spread_across_replicas():
    """DP 2 → 8 over two more nodes: a new replica on an old node pulls from node-mates only; replicas on
    new nodes spread over the old replicas instead of all reading from the first one."""
    job = tiny_job(nodes=4, gpus_per_node=4)
    old = plan([("reference/inference", {"tp": 2, "dp": 2}, [0, 1, 4, 5])], 16)
    new = plan([("reference/inference", {"tp": 2, "dp": 8}, range(16))], 16)
    graph, _ = build(job, old, new)
    on_old_nodes = [s for s in sends(graph) if s.dst // 4 in (0, 1)]
    assert on_old_nodes and all(s.src // 4 == s.dst // 4 for s in on_old_nodes)
    per_source = Counter(s.src for s in sends(graph) if s.dst // 4 in (2, 3))
    assert set(per_source) == {0, 1, 4, 5} and max(per_source.values()) - min(per_source.values()) <= 1


def test_large_sends_are_chunked_with_bounded_staging():
    job = tiny_job(nodes=2, gpus_per_node=4)
    old = plan([(TRAIN, {"tp": 1, "dp": 1}, [0])], 8)
    new = plan([(TRAIN, {"tp": 1, "dp": 2}, [0, 4])], 8)
    graph, sched = build(job, old, new, chunk_bytes=1000)
    (op,) = sends(graph)
    assert op.chunks == -(-op.bytes // 1000) > 1 and op.staging == 1000
    assert sched.end[op.id] - sched.start[op.id] > op.chunks * Hardware(job.cluster).priors.inter_latency_s


def test_commit_point_separates_the_old_layout_from_the_new():
    job = tiny_job()
    old = plan([(TRAIN, {"tp": 2, "pp": 2, "dp": 2}, range(8))], 8)
    new = plan([(TRAIN, {"tp": 4, "dp": 2}, range(8))], 8)
    graph, sched = build(job, old, new)
    commit = graph.commit
    for op in graph.steps:
        if op.kind in ("free", "alloc_grads", "drop_host"):
            assert op.after_commit and sched.start[op.id] >= sched.end[commit]
        if op.kind in ("send", "copy", "alloc"):
            assert not op.after_commit and sched.end[op.id] <= sched.start[commit]
        if op.kind == "free_early":
            assert op.state == "grads"  # nothing that holds state is freed before the commit
    assert graph.count()["group"] == 1  # the new layout's process groups


def test_destination_that_cannot_fit_is_refused_naming_device_bytes_and_capacity():
    old = plan([(TRAIN, {"tp": 4, "dp": 2}, range(8))], 8)
    new = plan([(TRAIN, {"tp": 1, "dp": 1}, [3])], 8)  # the whole model and its Adam state on one device
    probe = build_graph(tiny_job(nodes=1, gpus_per_node=8), old, new)
    usable = (max(probe.old_bytes) + probe.new_bytes[3]) / 2  # the old plan fits, GPU 3's new state does not
    small = tiny_job(nodes=1, gpus_per_node=8, memory_gb=usable / 0.9 / 1e9)
    with pytest.raises(TransitionMemoryError) as err:
        build_graph(small, old, new)
    e = err.value
    assert isinstance(e, InfeasibleError)
    assert e.device == 3 and e.needed_bytes == probe.new_bytes[3] > e.capacity_bytes
    assert str(e).startswith("GPU 3: the transition needs ") and "capacity is" in str(e)


def test_memory_detour_through_host_when_old_and_new_do_not_fit_together():
    """Weights only (no gradient buffers to release early): TP1 → TP2·PP2 needs the old full copy and the
    new quarter together; with room for 1.1 copies the old one goes to host memory first."""
    old = plan([("actor/inference", {"tp": 1, "dp": 4}, range(4))], 4)
    new = plan([("actor/inference", {"tp": 2, "pp": 2, "dp": 1}, range(4))], 4)
    probe = build_graph(tiny_job(nodes=1, gpus_per_node=4), old, new)
    usable = 1.1 * max(probe.old_bytes)
    job = tiny_job(nodes=1, gpus_per_node=4, memory_gb=usable / 0.9 / 1e9)
    graph, sched = build(job, old, new, chunk_bytes=256)
    assert graph.detours and graph.detour_bytes > 0
    offloads = {op.id for op in graph.steps if op.kind == "offload"}
    for op in graph.steps:
        if op.kind == "free_early":
            assert set(op.deps) & offloads  # freed before commit only once its bytes sit in host memory
    assert any(op.kind == "copy" and op.from_host for op in graph.steps)
    assert max(sched.peak_bytes) <= graph.capacity_bytes < max(o + n for o, n in zip(graph.old_bytes, graph.new_bytes,
                                                                                   strict=True))
    assert graph.bytes_sent == brute_force_lower_bound(job, old, new)  # the detour goes over PCIe only


def test_new_state_without_a_source_is_refused():
    job = tiny_job()
    old = plan([("actor/inference", {"tp": 2}, [0, 1])], 8)
    new = plan([(TRAIN, {"tp": 2}, [0, 1])], 8)
    with pytest.raises(SpecError, match="optimizer has no source"):
        build_graph(job, old, new)


# ----- verify must catch what is wrong -------------------------------------------------------------------

@pytest.fixture(scope="module")
def sound():
    job = tiny_job()
    old = plan([(TRAIN, {"tp": 2, "pp": 2, "dp": 2}, range(8)), ("critic/inference", {"tp": 1, "dp": 2}, [0, 4])], 8)
    new = plan([(TRAIN, {"tp": 4, "dp": 2}, [4, 5, 6, 7, 0, 1, 2, 3]), ("critic/inference", {"tp": 2}, [2, 3])], 8)
    hw = Hardware(job.cluster)
    graph = build_graph(job, old, new, hw)
    sched = schedule_graph(graph, hw)
    assert verify_transition(job, old, new, graph, sched, hw) == []
    return job, old, new, graph, sched, hw


def _first(graph, kind):
    return next(op for op in graph.steps if op.kind == kind)


def _with_step(graph, step):
    """The plan with one step replaced (steps are frozen: a mutation is a new plan)."""
    steps = list(graph.steps)
    steps[step.id] = step
    return replace(graph, steps=tuple(steps))


def _without_first_piece(op):
    part = op.parts[0]
    return replace(op, parts=(replace(part, pieces=part.pieces[1:]),) + op.parts[1:])


def test_verify_catches_a_missing_piece(sound):
    job, old, new, graph, _, _ = sound
    bad = _with_step(graph, _without_first_piece(_first(graph, "send")))
    assert any("cover" in p for p in verify_transition(job, old, new, bad))


def test_verify_catches_a_piece_received_twice(sound):
    job, old, new, graph, _, _ = sound
    op = _first(graph, "send")
    bad = _with_step(graph, replace(op, parts=op.parts + op.parts[:1]))
    found = verify_transition(job, old, new, bad)
    assert any("overlap" in p for p in found) and any("carries pieces" in p for p in found)


def test_verify_catches_a_send_of_what_the_destination_holds(sound):
    job, old, new, graph, _, _ = sound
    op = _first(graph, "copy")
    part = op.parts[0]
    p = part.pieces[0]
    # Replace the local copy by a send of the same piece from another device.
    bad = _with_step(graph, _without_first_piece(op))
    extra = replace(_first(graph, "send"), id=len(graph.steps), src=(op.device + 1) % 8, dst=op.device,
                    parts=(StatePart(part.model, part.state, (SentPiece(p.group, p.piece, p.dest),)),))
    bad = replace(bad, steps=bad.steps + (extra,))
    assert any("already holds it" in p for p in verify_transition(job, old, new, bad))


def test_verify_catches_a_free_before_the_commit(sound):
    _, _, _, graph, _, _ = sound
    found = check_commit(_with_step(graph, replace(_first(graph, "free"), deps=())))
    assert any("before the commit would break the old layout" in p for p in found)


def test_verify_catches_memory_over_capacity(sound):
    job, old, new, graph, sched, hw = sound
    bad = replace(graph, capacity_bytes=max(graph.old_bytes) // 2)
    found = verify_transition(job, old, new, bad, sched, hw)
    assert any("exceeds the usable" in p for p in found)


def test_verify_catches_a_broken_schedule(sound):
    job, old, new, graph, sched, hw = sound
    bad = copy.deepcopy(sched)
    op = _first(graph, "send")
    dep = op.deps[0]
    bad.start[op.id] = bad.end[dep] - 1.0
    bad.end[op.id] = bad.start[op.id] + (sched.end[op.id] - sched.start[op.id])
    found = verify_transition(job, old, new, graph, bad, hw)
    assert any("before its dependency" in p for p in found)
    with pytest.raises(TransitionInvariantError):
        assert_valid(job, old, new, graph, bad, hw)
