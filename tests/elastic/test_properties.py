"""Property tests over random pairs of plans (layouts and GPU sets) of random small models:
invariants 1, 2 and 4 hold, checked by ``verify`` and again by brute force with numpy masks."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nereus.cost.hardware import Hardware
from nereus.elastic.errors import TransitionMemoryError
from nereus.elastic.graph import TransitionOptions, build_graph
from nereus.elastic.plan import Send
from nereus.elastic.schedule import Links, schedule_graph
from nereus.elastic.transition import bandwidth_bound
from nereus.elastic.verify import verify_transition
from tests.elastic.helpers import STAGES, brute_force_coverage, brute_force_lower_bound, plan, tiny_job


@st.composite
def archs(draw) -> dict:
    heads = draw(st.sampled_from([2, 4, 8]))
    return {"layers": draw(st.integers(1, 6)), "hidden": heads * draw(st.sampled_from([2, 4])),
            "ffn_hidden": draw(st.integers(3, 24)), "heads": heads,
            "kv_heads": draw(st.sampled_from([k for k in (1, 2, 4, 8) if heads % k == 0])),
            "vocab": draw(st.integers(3, 41)), "tied_embeddings": draw(st.booleans()),
            "qkv_bias": draw(st.booleans())}


@st.composite
def placements(draw, arch: dict, num_gpus: int) -> tuple[dict, list[int]]:
    tps = [t for t in (1, 2, 4, 8) if arch["heads"] % t == 0 and t <= num_gpus
           and (t <= arch["kv_heads"] or t % arch["kv_heads"] == 0)]
    tp = draw(st.sampled_from(tps))
    pp = draw(st.integers(1, min(arch["layers"], num_gpus // tp)))
    dp = draw(st.integers(1, num_gpus // (tp * pp)))
    v = draw(st.sampled_from([v for v in (1, 2) if v == 1 or (pp > 1 and arch["layers"] % (pp * v) == 0)]))
    gpus = draw(st.permutations(list(range(num_gpus))))[: tp * pp * dp]
    sharding = draw(st.sampled_from(["none", "zero1", "fsdp"]))
    return ({"tp": tp, "pp": pp, "dp": dp, "interleave": v, "zero1": sharding == "zero1", "fsdp": sharding == "fsdp"},
            list(gpus))


@st.composite
def transitions(draw):
    arch = draw(archs())
    nodes, gpn = draw(st.integers(1, 3)), draw(st.sampled_from([2, 4]))
    n = nodes * gpn
    stages = draw(st.lists(st.sampled_from(STAGES), min_size=1, max_size=4, unique=True))
    old = [(ms, *draw(placements(arch, n))) for ms in stages]
    if draw(st.booleans()):  # change one model-stage only, keep the rest: exercises buffers kept in place
        new = list(old)
        i = draw(st.integers(0, len(old) - 1))
        new[i] = (old[i][0], *draw(placements(arch, n)))
    else:
        new = [(ms, *draw(placements(arch, n))) for ms in stages]
    return arch, nodes, gpn, old, new, draw(st.sampled_from([64, 512, 1 << 20]))


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(transitions())
def test_random_transitions_keep_every_invariant(case):
    arch, nodes, gpn, old_entries, new_entries, chunk = case
    job = tiny_job(arch, nodes, gpn)
    old, new = plan(old_entries, nodes * gpn), plan(new_entries, nodes * gpn)
    hw = Hardware(job.cluster)
    graph = build_graph(job, old, new, hw, TransitionOptions(chunk_bytes=chunk))
    sched = schedule_graph(graph, hw)
    assert verify_transition(job, old, new, graph, sched, hw) == []
    assert brute_force_coverage(job, new, graph) == []
    # Memory is ample here, so no detour: the bytes sent are exactly the owner-change lower bound.
    assert not graph.detours
    assert graph.bytes_sent == graph.lower_bound_bytes == brute_force_lower_bound(job, old, new)
    assert sched.makespan_s >= bandwidth_bound(graph, Links.of(hw)) * (1 - 1e-9)
    assert all(s.staging <= chunk for s in graph.steps if isinstance(s, Send))


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(transitions(), st.floats(0.0, 1.0))
def test_tight_memory_either_fits_or_is_refused_with_the_numbers(case, squeeze):
    """Capacity between the larger of the two plans and their sum: the graph must either fit every device
    at every point (with host detours when needed) or refuse, naming a device and bytes over capacity."""
    arch, nodes, gpn, old_entries, new_entries, _ = case
    roomy = tiny_job(arch, nodes, gpn)
    old, new = plan(old_entries, nodes * gpn), plan(new_entries, nodes * gpn)
    probe = build_graph(roomy, old, new)
    most = max(max(probe.old_bytes), max(probe.new_bytes))
    both = max(o + n for o, n in zip(probe.old_bytes, probe.new_bytes, strict=True))
    usable = most + squeeze * (both - most)
    job = tiny_job(arch, nodes, gpn, memory_gb=max(usable / 0.9, 1100) / 1e9)  # usable = 90% of a small device
    hw = Hardware(job.cluster)
    try:
        graph = build_graph(job, old, new, hw, TransitionOptions(chunk_bytes=64))
        sched = schedule_graph(graph, hw)
    except TransitionMemoryError as err:
        assert err.needed_bytes > err.capacity_bytes
        assert f"GPU {err.device}:" in str(err) and "capacity is" in str(err)
        return
    assert verify_transition(job, old, new, graph, sched, hw) == []
    assert max(sched.peak_bytes) <= graph.capacity_bytes
    if not graph.detours:
        assert graph.bytes_sent == brute_force_lower_bound(job, old, new)
    else:
        assert graph.detour_bytes > 0 and all(d.bytes > 0 for d in graph.detours)


@pytest.mark.parametrize("preset", ["qwen2.5-0.5b", "llama3-8b"])
def test_published_architectures_on_a_node(preset):
    """Real shapes (GQA with 2 and 8 KV heads, tied embeddings, QKV bias, odd vocabularies) cut to two
    layers: TP 2 → 4 (Qwen: 2 → 2 with DP) and PP 1 → 2 of a training model with ZeRO-1, tensor by tensor."""
    from nereus.spec.model import PRESETS

    a = PRESETS[preset]
    arch = {"layers": 2, "hidden": a.hidden, "ffn_hidden": a.ffn_hidden, "heads": a.heads,
            "kv_heads": a.kv_heads, "vocab": a.vocab, "tied_embeddings": a.tied_embeddings, "qkv_bias": a.qkv_bias}
    tp = 4 if a.heads % 4 == 0 else 2
    job = tiny_job(arch, 1, 8)
    old = plan([("actor/training", {"tp": 2, "dp": 4}, list(range(8)))], 8)
    new = plan([("actor/training", {"tp": tp, "pp": 2, "dp": 8 // (2 * tp)}, [7, 6, 5, 4, 3, 2, 1, 0])], 8)
    hw = Hardware(job.cluster)
    graph = build_graph(job, old, new, hw)
    sched = schedule_graph(graph, hw)
    assert verify_transition(job, old, new, graph, sched, hw) == []
    assert graph.bytes_sent == graph.lower_bound_bytes > 0
