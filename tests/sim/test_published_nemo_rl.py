"""NeMo RL's defaults (``published_frameworks``): its name in any spelling, a colocated row's trainer state
off the GPU during the rollout (the Megatron worker's ``offload_after_refit``), a rollout on GPUs of its own
refitted by a bucketed broadcast (``cost.verl_weight_sync.packed_broadcast_time``), and a colocated row
of any framework that leaves ``offload`` empty yet finds no room for its rollout priced with its state off."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from nereus.cost.hardware import Hardware
from nereus.cost.memory import BF16
from nereus.cost.sync_host_costs import engine_load_time, export_time
from nereus.cost.verl_weight_sync import (
    PACKED_BUCKET_FRACTION,
    broadcast_time,
    packed_broadcast_time,
    tensor_broadcast_time,
)
from nereus.sim.published_frameworks import framework_of, framework_recompute
from nereus.sim.published_predict import cost_times, with_room_for_the_rollout
from nereus.sim.published_runs import published_run
from nereus.spec.cluster import nvlink_node
from nereus.spec.layout import ModelStage
from tests.helpers import published_rows


def rows() -> dict[str, dict]:
    return published_rows("e2e_runs_nemo_rl.csv")


@pytest.mark.parametrize("name", ["NeMo-RL", "NeMo RL", "nemo_rl", " nemo-rl "])
def test_every_spelling_of_the_name_finds_its_defaults(name: str) -> None:
    assert framework_of({"framework": name}).name == "NeMo-RL"


def test_a_colocated_row_keeps_no_trainer_state_beside_the_rollout_a_disaggregated_one_keeps_its_own() -> None:
    on, off = published_run(rows()["nemorl_q235_128"]), published_run(rows()["nemorl_q235_256_1off"])
    assert on.plan.strategy == "colocated" and on.job.options.offload == "param+optimizer-swap"
    assert on.job.options.pageable_offload == "optimizer"  # move_optimizer's Tensor.to, every step
    assert off.plan.strategy == "disaggregated" and off.job.options.offload == "none"
    assert off.plan.weight_sync == "packed-broadcast"


def test_the_packed_broadcast_runs_at_its_slowest_part_plus_one_bucket() -> None:
    run = published_run(rows()["nemorl_dsv3_512_1off"])
    hw = Hardware(run.job.cluster)
    train, gen = (run.plan.placement(ModelStage("actor", s)) for s in ("training", "generation"))
    bucket = PACKED_BUCKET_FRACTION * hw.cluster.gpu.memory_bytes  # 1.6 GB on an H100, under the 5 GiB cap
    buckets = math.ceil(run.job.models["actor"].params() * BF16 / bucket)
    link, load = broadcast_time(hw, run.job, train, gen, buckets), engine_load_time(run.job, buckets)
    want = max(export_time(hw, run.job, train.layout), link, load) + (link + load) / buckets
    assert packed_broadcast_time(hw, run.job, train, gen) == pytest.approx(want)
    assert packed_broadcast_time(hw, run.job, train, gen) < tensor_broadcast_time(hw, run.job, train, gen) / 2


def test_a_colocated_row_without_room_for_its_rollout_is_priced_with_its_state_off_the_gpu() -> None:
    row = {**rows()["nemorl_dsv3_256"], "framework": "other-framework"}  # no colocated default of its own
    run = published_run(row)
    assert run.job.options.offload == "none" and not run.offload_stated
    assert not math.isfinite(cost_times(run).stages["actor/generation"])
    roomy = with_room_for_the_rollout(run)
    assert roomy.job.options.offload == "param+optimizer-swap"
    assert math.isfinite(cost_times(roomy).stages["actor/generation"])
    stated = replace(run, offload_stated=True)  # a row that says "none" is priced as it says
    assert with_room_for_the_rollout(stated) is stated


@pytest.mark.parametrize(("run_id", "recompute"), [
    ("nemorl_llama8b_16", "full"), ("nemorl_dsv3_512", "full"), ("nemorl_q235_gb_64", "full"),
    ("nemorl_q30_32", "none"), ("nemorl_q32_32", "none")])
def test_training_recomputes_where_the_models_performance_recipe_does(run_id: str, recompute: str) -> None:
    """NeMo RL's performance recipes turn on activation checkpointing for DeepSeek-V3, Qwen3-235B-A22B and
    Llama-3.1-8B and leave it off for Qwen3-30B-A3B and Qwen3-32B; a dense verl Megatron row keeps Megatron's
    none."""
    row = rows()[run_id]
    assert framework_recompute(row) == recompute
    assert published_run(row).plan.placement("actor/training").layout.recompute == recompute
    assert framework_recompute({**row, "framework": "verl"}) == ""  # verl publishes no per-size table
    if row["arch"] == "dense":  # (an MoE row as verl's would take its verl MoE script's)
        verl = published_run({**row, "framework": "verl"})
        assert verl.plan.placement("actor/training").layout.recompute == "none"


@pytest.mark.parametrize(("total", "per_node", "domain", "node"), [(128, 4, 72, 64), (256, 4, 72, 64), (16, 4, 72, 16),
                                                                   (36, 4, 72, 36), (64, 8, 8, 8), (12, 4, 8, 4)])
def test_the_cost_models_node_is_the_nvlink_domain_a_rows_hosts_fit_in(total: int, per_node: int, domain: int,
                                                                       node: int) -> None:
    assert nvlink_node(domain, total, per_node) == node


def test_a_gb200_row_written_as_4_gpu_hosts_is_priced_on_its_racks_nvlink() -> None:
    """NeMo RL's GB200 runs are 4-GPU trays of NVL72 racks: NVLink joins the rack, so the training's EP16
    all-to-all and the rollout's TP stay on NVLink, as a row that gives the domain itself prices them."""
    hosts = published_run(rows()["nemorl_dsv3_gb_128"])
    assert hosts.job.cluster.gpus_per_node == 64
    domain = published_run({**rows()["nemorl_dsv3_gb_128"], "gpus_per_node": "64"})
    assert cost_times(hosts) == cost_times(domain)
    h100 = published_run(rows()["nemorl_dsv3_256"])
    assert h100.job.cluster.gpus_per_node == 8  # an HGX board is its own domain
