"""The share of each rollout GPU's memory a published run's engine takes (vLLM's and verl's
``gpu_memory_utilization``): its KV cache is that share of the device's memory less the engine's weights and
reserved memory (``cost.hardware.kv_cache_budget``), never more than is free; a row states it, else its verl
MoE recipe or its framework's configs give it, else the cost model's prior stands; a row whose share is not
one is skipped naming the cell."""

from __future__ import annotations

import math

import pytest

from nereus.cost.hardware import GIB, Hardware, device_memory_bytes, kv_cache_budget
from nereus.sim.published_predict import cost_times
from nereus.sim.published_runs import RowSkipped, published_run
from nereus.spec.cluster import ClusterSpec, gpu_presets
from tests.helpers import published_rows as rows


def h100() -> Hardware:
    return Hardware(ClusterSpec(gpu_presets()["H100-SXM-80GB"], 1, 8))


def test_a_share_of_the_device_less_the_engines_weights_and_reserve() -> None:
    hw, weights = h100(), 16e9
    assert device_memory_bytes(hw) == 80 * GIB  # a datasheet's 80 GB of HBM is binary
    assert kv_cache_budget(hw, weights, 0.0, 0.6) == pytest.approx(0.6 * 80 * GIB - weights - hw.priors.reserved_bytes)
    assert kv_cache_budget(hw, weights, 0.0) == pytest.approx((hw.usable_bytes() - weights) * 0.9)  # the prior


def test_never_more_than_is_free_beside_the_colocated_models() -> None:
    hw, weights, others = h100(), 16e9, 40e9
    assert kv_cache_budget(hw, weights, others, 0.95) == pytest.approx(kv_cache_budget(hw, weights, others))
    assert kv_cache_budget(hw, weights, 0.0, 0.3) < kv_cache_budget(hw, weights, 0.0, 0.6)


def nemo() -> dict[str, dict]:
    return rows("e2e_runs_nemo_rl.csv")


def test_where_each_rows_share_comes_from() -> None:
    share = {run_id: published_run(row).job.options.gpu_memory_utilization
             for run_id, row in {**rows(), **nemo()}.items() if not run_id.startswith("verl_wsync")}
    assert share["nemorl_q30_32"] == 0.6  # NeMo RL's base config, colocated
    assert share["nemorl_q30_32_1off"] == 0.8  # its async-1off recipes, the rollout on GPUs of its own
    assert share["nemorl_dsv3_gb_128"] == 0.3  # stated by the row, as its recipe sets it
    assert share["verl_fa30_2"] == 0.7  # verl's Megatron Qwen3-30B-A3B script
    assert share["verl_dsv3_1"] == 0.6  # verl's DeepSeek-V3 script
    assert share["verl_oso_1"] == 0.0 and share["openrlhf_7B"] == 0.0  # no source: the prior
    stated = {**rows()["verl_oso_1"], "gpu_memory_utilization": "0.5"}
    assert published_run(stated).job.options.gpu_memory_utilization == 0.5


@pytest.mark.parametrize("written", ["1.5", "0", "most"])
def test_a_share_that_is_not_one_skips_the_row_naming_the_cell(written: str) -> None:
    with pytest.raises(RowSkipped, match="gpu_memory_utilization"):
        published_run({**rows()["verl_oso_1"], "gpu_memory_utilization": written})


def test_a_smaller_share_slows_a_rollout_its_kv_cache_binds() -> None:
    """NeMo RL's Qwen3-30B-A3B on 32 H100s: 128 sequences of ~3,200 tokens a TP-2 replica need more KV cache
    than 0.6 of each GPU leaves beside 30.5 GB of weights, so the rollout queues; with the whole GPU it does
    not, and less than that share only slows it more."""
    row = nemo()["nemorl_q30_32"]
    generation = {}
    for share in ("0.4", "0.6", "0.95"):
        run = published_run({**row, "gpu_memory_utilization": share})
        generation[share] = cost_times(run).stages["actor/generation"]
    assert all(math.isfinite(t) for t in generation.values())
    assert generation["0.4"] > generation["0.6"] > generation["0.95"]
