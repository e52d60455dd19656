"""verl's disaggregated weight sync with and without its checkpoint engine (cost.verl_weight_sync)."""

from __future__ import annotations

import csv
from importlib import resources

import pytest

from nereus.cost.hardware import Hardware, pcie_bytes_per_s
from nereus.cost.memory import BF16
from nereus.cost.sync_host_costs import (
    DTENSOR_GATHER_S,
    engine_call_time,
    engine_load_time,
    export_time,
    megatron_parameters,
)
from nereus.cost.verl_weight_sync import (
    SYNC_FLOORS,
    SYNC_TIMES,
    broadcast_floor,
    broadcast_time,
    checkpoint_engine_time,
    host_copy_bytes_per_s,
    tensor_broadcast_time,
)
from nereus.cost.weight_sync import checkpoint_tensors
from nereus.sim.published_runs import published_run
from nereus.spec.layout import Layout, ModelStage, Placement


def _run(run_id: str):
    text = resources.files("nereus.cost").joinpath("e2e_runs.csv").read_text()
    rows = csv.DictReader(line for line in text.splitlines() if not line.startswith("#"))
    return published_run(next(r for r in rows if r["run_id"] == run_id))


def _sync(run, mechanism):
    hw = Hardware(run.job.cluster)
    train = run.plan.placement(ModelStage("actor", "training"))
    gen = run.plan.placement(ModelStage("actor", "generation"))
    return mechanism(hw, run.job, train, gen), hw


def test_the_rows_checkpoint_engine_column_picks_the_mechanism() -> None:
    assert _run("verl_wsync_1").plan.weight_sync == "tensor-broadcast"  # checkpoint_engine no
    assert _run("verl_wsync_2").plan.weight_sync == "checkpoint-engine"  # checkpoint_engine yes
    assert _run("verl_fa_2").plan.weight_sync == "checkpoint-engine"  # empty: verl's fully-async default
    assert _run("verl_oso_2").plan.weight_sync == "tensor-broadcast"  # empty: one-step-off has no engine
    assert _run("verl_fa_1").plan.weight_sync == "hybrid-reshard"  # colocated


def test_a_dense_checkpoint_counts_nine_tensors_a_layer() -> None:
    job = _run("verl_wsync_1").job  # 28 layers (the schema carries no QKV biases), embedding, norm, head
    assert checkpoint_tensors(job) == 28 * 9 + 3


def _placements(run):
    return (run.plan.placement(ModelStage("actor", "training")),
            run.plan.placement(ModelStage("actor", "generation")))


def test_each_load_call_walks_the_whole_engine_model() -> None:
    dense, moe, large = (_run(r).job for r in ("verl_wsync_1", "verl_wsync_3", "verl_wsync_5"))
    assert engine_call_time(dense) < engine_call_time(moe) < engine_call_time(large)  # layers, expert table
    tensors = checkpoint_tensors(moe)
    per_tensor, per_bucket = engine_load_time(moe, calls=tensors), engine_load_time(moe, calls=16)
    assert per_tensor - per_bucket == pytest.approx((tensors - 16) * engine_call_time(moe))
    assert 0 < per_bucket < per_tensor / 10  # the loader's per-tensor work stays when the calls go


def test_the_per_tensor_sync_adds_the_link_to_the_slower_host_loop() -> None:
    run = _run("verl_wsync_3")
    hw, (train, gen) = Hardware(run.job.cluster), _placements(run)
    tensors = checkpoint_tensors(run.job)
    loops = max(export_time(hw, run.job, train.layout), engine_load_time(run.job, calls=tensors))
    link = broadcast_time(hw, run.job, train, gen, calls=tensors)
    assert tensor_broadcast_time(hw, run.job, train, gen) == pytest.approx(loops + link)
    assert engine_load_time(run.job, calls=tensors) > export_time(hw, run.job, train.layout)  # the engine's


def test_a_broadcast_leaves_the_node_through_one_nic() -> None:
    run = _run("verl_wsync_3")  # four nodes of eight
    hw, (train, gen) = Hardware(run.job.cluster), _placements(run)
    weights = run.job.models["actor"].params() * BF16
    assert broadcast_time(hw, run.job, train, gen, calls=0) == pytest.approx(hw.p2p_time(weights, True))
    one_node = (Placement(train.model_stage, Layout(dp=4), (0, 1, 2, 3)),
                Placement(gen.model_stage, Layout(dp=4), (4, 5, 6, 7)))
    inside = broadcast_time(hw, run.job, *one_node, calls=0)
    assert inside == pytest.approx(hw.p2p_time(weights, False)) and inside < weights / 100e9
    calls = broadcast_time(hw, run.job, train, gen, calls=1000) - broadcast_time(hw, run.job, train, gen, calls=0)
    assert calls > broadcast_time(hw, run.job, *one_node, calls=1000) - inside  # a network hop per call


def test_the_checkpoint_engine_trades_per_tensor_calls_for_host_copies() -> None:
    run = _run("verl_wsync_4")  # Qwen3-30B-A3B: 18,771 checkpoint tensors
    hw, (train, gen) = Hardware(run.job.cluster), _placements(run)
    bucketed = checkpoint_engine_time(hw, run.job, train, gen)
    assert bucketed < tensor_broadcast_time(hw, run.job, train, gen) / 2
    share = run.job.models["actor"].params() * BF16 / len(train.gpus)
    assert bucketed > 2 * share / pcie_bytes_per_s(hw)  # each rank's share to the host and back
    fewer = Placement(train.model_stage, train.layout, train.gpus[:8])  # half the ranks: twice the share each
    assert checkpoint_engine_time(hw, run.job, fewer, gen) > bucketed
    alone = Placement(train.model_stage, train.layout, train.gpus[:1])  # one rank packs with its node's memory
    assert host_copy_bytes_per_s(hw, alone) == pytest.approx(8 * host_copy_bytes_per_s(hw, fewer))


def test_megatron_exports_its_local_experts_and_fsdp_gathers_every_tensor() -> None:
    run = _run("verl_wsync_3")
    hw, layout = Hardware(run.job.cluster), _placements(run)[0].layout
    no_ep = Layout(**{**layout.to_dict(), "ep": 1})
    assert megatron_parameters(run.job, no_ep) > megatron_parameters(run.job, layout)  # experts / ep a rank
    assert export_time(hw, run.job, no_ep) > export_time(hw, run.job, layout)  # more object collectives
    fsdp = Layout(**{**layout.to_dict(), "ep": 1, "fsdp": True, "zero1": False})
    tensors = checkpoint_tensors(run.job)
    assert export_time(hw, run.job, fsdp) > tensors * DTENSOR_GATHER_S  # one DTensor gather a tensor


def test_a_hopper_board_copies_over_pcie_5() -> None:
    hw = Hardware(_run("verl_wsync_1").job.cluster)
    assert pcie_bytes_per_s(hw) == pytest.approx(63e9)  # H20: PCIe 5.0 x16


@pytest.mark.parametrize("run_id", ["verl_wsync_1", "verl_wsync_3", "verl_wsync_5", "verl_wsync_7"])
def test_no_broadcast_is_priced_below_its_floor(run_id: str) -> None:
    run = _run(run_id)
    floor, hw = _sync(run, broadcast_floor)
    gpu = hw.cluster.gpu
    assert floor == pytest.approx(run.job.models["actor"].params() * BF16
                                  / (gpu.intra_node_bytes_per_s + gpu.inter_node_bytes_per_s))
    for mechanism in (tensor_broadcast_time, checkpoint_engine_time):
        assert _sync(run, mechanism)[0] > floor
    assert set(SYNC_FLOORS) <= set(SYNC_TIMES)


def test_the_seven_b_checkpoint_engine_row_is_below_the_floor() -> None:
    run = _run("verl_wsync_2")  # 15.2 GB into each H20 receiver: 30 ms at 450 + 50 GB/s, published 20 ms
    floor, _ = _sync(run, SYNC_FLOORS[run.plan.weight_sync])
    assert run.published["t_weight_sync_s"] < floor < 0.035
