"""verl's disaggregated weight sync with and without its checkpoint engine (cost.verl_weight_sync)."""

from __future__ import annotations

import csv
from importlib import resources

import pytest

from nereus.cost.hardware import Hardware
from nereus.cost.memory import BF16
from nereus.cost.verl_weight_sync import (
    checkpoint_engine_time,
    checkpoint_tensors_with_experts,
    pcie_bytes_per_s,
    tensor_broadcast_time,
)
from nereus.cost.weight_sync import ENGINE_RELOAD_PER_TENSOR_S
from nereus.sim.published_runs import published_run
from nereus.spec.layout import ModelStage


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
    assert checkpoint_tensors_with_experts(job) == 28 * 9 + 3


def test_the_checkpoint_engine_replaces_per_tensor_calls_with_bucketed_host_copies() -> None:
    run = _run("verl_wsync_1")
    per_tensor, hw = _sync(run, tensor_broadcast_time)
    bucketed, _ = _sync(run, checkpoint_engine_time)
    assert per_tensor > checkpoint_tensors_with_experts(run.job) * ENGINE_RELOAD_PER_TENSOR_S
    weights = run.job.models["actor"].params() * BF16
    assert bucketed > weights / (4 * pcie_bytes_per_s(hw))  # four trainer ranks copy their shares in parallel
    assert bucketed < per_tensor


def test_a_hopper_board_copies_over_pcie_5() -> None:
    hw = Hardware(_run("verl_wsync_1").job.cluster)
    assert pcie_bytes_per_s(hw) == pytest.approx(63e9)  # H20: PCIe 5.0 x16
