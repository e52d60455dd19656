"""The cluster model of the scheduler (ports, bandwidths, latencies, memory) and the baselines."""

from __future__ import annotations

import pytest

from nereus.cost.hardware import Hardware
from nereus.elastic.baselines import baseline_times, checkpoint_time
from nereus.elastic.graph import TransitionOptions, build_graph
from nereus.elastic.schedule import Links, schedule_graph
from nereus.elastic.transition import bandwidth_bound, plan_transition
from tests.elastic.helpers import plan, tiny_job

W = "reference/inference"


def one_send_time(job, old, new, **opts):
    hw = Hardware(job.cluster)
    graph = build_graph(job, old, new, hw, TransitionOptions(**opts))
    return graph, schedule_graph(graph, hw), Links.of(hw)


def test_a_cross_node_send_costs_bytes_over_the_nic_plus_chunk_latency():
    job = tiny_job(nodes=2, gpus_per_node=4)
    graph, sched, links = one_send_time(job, plan([(W, {}, [0])], 8), plan([(W, {"dp": 2}, [0, 4])], 8),
                                        chunk_bytes=4096)
    (op,) = [op for op in graph.steps if op.kind == "send"]
    assert sched.makespan_s == pytest.approx(op.bytes / links.ib + op.chunks * links.inter_latency_s)
    assert links.ib == pytest.approx(50e9 * 0.8)  # H100 NIC 400 Gb/s at the 80% efficiency prior


def test_the_same_send_inside_a_node_uses_nvlink():
    job = tiny_job(nodes=1, gpus_per_node=8)
    graph, sched, links = one_send_time(job, plan([(W, {}, [0])], 8), plan([(W, {"dp": 2}, [0, 1])], 8))
    (op,) = [op for op in graph.steps if op.kind == "send"]
    assert sched.makespan_s == pytest.approx(op.bytes / links.nvlink + links.intra_latency_s)


def test_receives_into_one_device_serialize_while_opposite_directions_overlap():
    job = tiny_job(nodes=3, gpus_per_node=1)
    # GPU 2 receives a full copy from each of two models' holders: its NIC takes them one after the other.
    old = plan([(W, {}, [0]), ("reward/inference", {}, [1])], 3)
    new = plan([(W, {}, [2]), ("reward/inference", {}, [2])], 3)
    graph, sched, links = one_send_time(job, old, new)
    a, b = [op for op in graph.steps if op.kind == "send"]
    assert sched.makespan_s == pytest.approx(sum(op.bytes / links.ib + links.inter_latency_s for op in (a, b)))
    # Swapping two devices' models: each NIC sends and receives at once (full duplex).
    swap = plan([(W, {}, [1]), ("reward/inference", {}, [0])], 3)
    graph, sched, links = one_send_time(job, old, swap)
    assert sched.makespan_s == pytest.approx(max(op.bytes / links.ib + links.inter_latency_s
                                                 for op in graph.steps if op.kind == "send"))


def test_staging_waits_for_memory():
    """Room for one staging chunk beside the state: the receiver takes its two transfers one at a time even
    though they come over different links (one over NVLink, one over InfiniBand)."""
    roomy = tiny_job(nodes=2, gpus_per_node=2)
    old = plan([(W, {}, [1]), ("reward/inference", {}, [2])], 4)
    new = plan([(W, {}, [0]), ("reward/inference", {}, [0])], 4)
    probe = build_graph(roomy, old, new, options=TransitionOptions(chunk_bytes=512))
    usable = probe.new_bytes[0] + 600  # one 512-byte staging buffer fits, two do not
    job = tiny_job(nodes=2, gpus_per_node=2, memory_gb=usable / 0.9 / 1e9)
    graph, sched, _ = one_send_time(job, old, new, chunk_bytes=512)
    a, b = sorted((op for op in graph.steps if op.kind == "send"), key=lambda op: sched.start[op.id])
    assert sched.start[b.id] >= sched.end[a.id]
    assert max(sched.peak_bytes) <= graph.capacity_bytes


def test_makespan_is_never_below_the_bandwidth_bound_and_baselines_are_slower():
    # Large enough (~60 MB per copy) that bandwidth, not per-message latency, sets the times.
    job = tiny_job({"layers": 4, "hidden": 1024, "ffn_hidden": 2816, "heads": 8, "kv_heads": 2, "vocab": 4000},
                   nodes=2, gpus_per_node=4)
    old = plan([("actor/training", {"tp": 2, "pp": 2, "dp": 2}, range(8))], 8)
    new = plan([("actor/training", {"tp": 4, "dp": 2}, range(8))], 8)
    result = plan_transition(job, old, new)
    r = result.report
    assert r.bandwidth_bound_s <= r.predicted_s
    assert r.bandwidth_bound_s == pytest.approx(bandwidth_bound(result.graph, Links.of(Hardware(job.cluster))))
    assert set(r.baselines_s) == {"checkpoint", "gather_scatter", "broadcast"}
    assert all(t > r.predicted_s for t in r.baselines_s.values())


def test_checkpoint_baseline_is_save_plus_the_busiest_node_load():
    job = tiny_job(nodes=2, gpus_per_node=2)
    old = plan([(W, {}, [0])], 4)
    new = plan([(W, {"dp": 2}, [2, 3])], 4)
    graph = build_graph(job, old, new)
    full = graph.state_bytes["reference/weights"].bytes
    # Saved once from node 0; node 1 loads two copies (GPUs 2 and 3).
    assert checkpoint_time(graph, 1e9) == pytest.approx(full / 1e9 + 2 * full / 1e9)
    times = baseline_times(graph, Links.of(Hardware(job.cluster)), 1e9)
    assert times["checkpoint"] == checkpoint_time(graph, 1e9)
