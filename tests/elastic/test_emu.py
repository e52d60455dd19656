"""EMUs and the sharding contract's additions: interleaved stages, flat ranges, ZeRO/FSDP shards."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nereus.cost.memory import BF16, OPTIMIZER_BYTES_PER_PARAM, stage_params
from nereus.elastic.emu import build_emus, device_buffers
from nereus.spec import Layout, SpecError
from nereus.spec.model import PRESETS, ModelArch
from nereus.spec.sharding import (
    box_volume,
    flat_range_boxes,
    layer_range,
    model_tensors,
    rank_order,
    rank_tensors,
    zero_shards,
)
from tests.elastic.helpers import mask, plan, tensor_shapes, tiny_job


def test_interleaving_keeps_contiguous_layer_ranges():
    """The contract places stages by contiguous ranges whatever the interleaving (the runtime builds them
    so); EMUs of an interleaved layout hold what ``rank_tensors`` says."""
    job = tiny_job({"layers": 8, "hidden": 16, "ffn_hidden": 24, "heads": 4, "kv_heads": 2, "vocab": 19}, 1, 4)
    arch = job.models["actor"]
    for v in (1, 2, 4):
        lay = Layout(pp=2, dp=2, interleave=v)
        p = plan([("actor/inference", {"pp": 2, "dp": 2, "interleave": v}, range(4))], 4)
        held: dict[int, set[str]] = {}
        for e in build_emus(job, p):
            for t in e.tensors:
                for s in t.shards:
                    held.setdefault(s.device, set()).add(t.name)
        for rank in range(4):
            assert held[rank] == set(rank_tensors(arch, lay.dims, rank))
            layers = {int(n.split(".")[2]) for n in held[rank] if n.startswith("model.layers.")}
            assert layers == set(layer_range(8, 2, lay.dims.coords(rank).pp_rank))


@given(st.lists(st.integers(1, 5), min_size=1, max_size=3), st.data())
def test_flat_range_boxes_are_exactly_the_flat_range(shape, data):
    n = int(np.prod(shape))
    lo = data.draw(st.integers(0, n))
    hi = data.draw(st.integers(lo, n))
    start = [data.draw(st.integers(0, 3)) for _ in shape]
    box = tuple((s, s + d) for s, d in zip(start, shape, strict=True))
    got = mask(tuple(s + d for s, d in zip(start, shape, strict=True)), [flat_range_boxes(box, lo, hi)])
    want = np.zeros_like(got)
    region = want[tuple(slice(a, b) for a, b in box)].reshape(-1)
    region[lo:hi] = 1
    want[tuple(slice(a, b) for a, b in box)] = region.reshape(shape)
    assert np.array_equal(got, want)
    assert len(flat_range_boxes(box, lo, hi)) <= 2 * len(shape) - 1 or len(shape) == 1


@pytest.mark.parametrize("tp,dp", [(1, 3), (2, 5), (4, 2)])
def test_zero_shards_split_a_rank_flat_buffer_in_checkpoint_order(tp, dp):
    arch = ModelArch(2, 16, 24, 4, 2, 37, qkv_bias=True)
    lay = Layout(tp=tp, dp=dp)
    shapes = {t.name: t.shape for t in model_tensors(arch)}
    for t in range(tp):
        order = rank_order(arch, lay.dims, 0, t)
        assert [n for n, _ in order] == list(rank_tensors(arch, lay.dims, t))  # same tensors, checkpoint order
        sizes = [sum(box_volume(b) for bs in zero_shards(arch, lay.dims, 0, t, r).values() for b in bs)
                 for r in range(dp)]
        assert max(sizes) - min(sizes) <= 1  # near-equal ranges
        for name, box in order:
            parts = [zero_shards(arch, lay.dims, 0, t, r).get(name, ()) for r in range(dp)]
            assert np.array_equal(mask(shapes[name], parts), mask(shapes[name], [(box,)]))  # each element once
        owners = [r for name, _ in order for r in range(dp) if name in zero_shards(arch, lay.dims, 0, t, r)]
        assert owners == sorted(owners)  # contiguous ranges follow checkpoint order


@pytest.mark.parametrize("layout", [dict(tp=2, pp=2, dp=2), dict(tp=4, dp=2, zero1=False), dict(tp=1, pp=3, dp=2),
                                    dict(tp=2, dp=4, fsdp=True), dict(tp=8, dp=1)])
def test_each_replica_covers_weights_once_and_replicas_cover_the_optimizer(layout):
    job = tiny_job({"layers": 3, "hidden": 32, "ffn_hidden": 40, "heads": 8, "kv_heads": 2, "vocab": 29}, 2, 4)
    world = layout.get("tp", 1) * layout.get("pp", 1) * layout["dp"]
    p = plan([("critic/training", layout, list(range(world)))], 8)
    shapes = tensor_shapes(job)
    emus = build_emus(job, p)
    assert len(emus) == layout["dp"]
    fsdp, zero = layout.get("fsdp", False), layout.get("zero1", True) or layout.get("fsdp", False)
    for state, sharded in (("weights", fsdp), ("optimizer", zero), ("grads", fsdp)):
        for name in {t.name for t in emus[0].tensors}:
            per_replica = [np.clip(mask(shapes[("critic", name)], [s.boxes for t in e.tensors if t.name == name
                                                                    and t.state == state for s in t.shards]), 0, 1)
                           for e in emus]
            total = sum(per_replica)
            if sharded:  # together the replicas cover each element exactly once (TP copies aside)
                assert total.min() == total.max() == 1, (state, name)
            else:  # every replica covers every element
                assert all(r.min() == 1 for r in per_replica), (state, name)


@pytest.mark.parametrize("tp,pp,dp,zero1", [(1, 1, 8, True), (2, 4, 8, True), (8, 1, 4, False), (4, 2, 2, True)])
def test_emu_bytes_match_the_cost_model(tp, pp, dp, zero1):
    """The fullest device's weights and optimizer state agree with nereus.cost.memory within 1%."""
    from tests.helpers import ppo_job

    job = ppo_job(64)
    arch = job.models["actor"]
    lay = Layout(tp=tp, pp=pp, dp=dp, zero1=zero1)
    p = plan([("actor/training", dict(tp=tp, pp=pp, dp=dp, zero1=zero1), list(range(tp * pp * dp)))], 64)
    per_device: dict[int, dict[str, int]] = {}
    for emu in build_emus(job, p):
        for t in emu.tensors:
            for s in t.shards:
                d = per_device.setdefault(s.device, {})
                d[t.state] = d.get(t.state, 0) + sum(box_volume(b) for b in s.boxes) * t.bytes_per_element
    params = stage_params(arch, lay, False)
    assert max(d["weights"] for d in per_device.values()) == pytest.approx(params * BF16, rel=0.01)
    shard = dp if zero1 else 1
    assert max(d["optimizer"] for d in per_device.values()) == pytest.approx(
        params * OPTIMIZER_BYTES_PER_PARAM / shard, rel=0.01)


def test_two_stages_of_a_model_share_equal_buffers():
    job = tiny_job()
    p = plan([("actor/inference", {"tp": 2, "dp": 4}, list(range(8))),
              ("actor/training", {"tp": 2, "dp": 4}, list(range(8)))], 8)
    bufs = device_buffers(job, p)
    assert all(len(sets) == 1 for dev in bufs.values() for (m, st, _), sets in dev.items() if st == "weights")


@pytest.mark.parametrize("layout,field", [({"tp": 3}, "layout.tp"), ({"tp": 2, "pp": 5}, "layout.pp"),
                                          ({"pp": 2, "interleave": 3}, "layout.pp")])
def test_plans_the_contract_cannot_place_are_refused_by_field(layout, field):
    world = layout.get("tp", 1) * layout.get("pp", 1)
    p = plan([("actor/training", layout, list(range(world)))], 64)
    job = tiny_job(nodes=8, gpus_per_node=8)  # 4 layers, 4 heads, 2 KV heads
    with pytest.raises(SpecError) as err:
        build_emus(job, p)
    assert err.value.path == f"plan.placements[0].{field}"


def test_real_gqa_model_shards_are_whole_kv_heads():
    arch = PRESETS["llama3-8b"]
    for t in range(8):
        boxes = rank_tensors(arch, Layout(tp=8).dims, t)
        k = boxes["model.layers.0.self_attn.k_proj.weight"]
        assert k[0] == (t * 128, (t + 1) * 128)  # one KV head (head_dim 128) per rank
