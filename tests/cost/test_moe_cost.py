"""MoE cost terms (``nereus.cost.moe`` and its uses in ``cost.stages``): the experts a batch hits, the
experts' memory per rank under expert parallelism, the all-to-all's links, and dense models untouched."""

from __future__ import annotations

from dataclasses import replace

import pytest

from nereus.cost.hardware import Hardware
from nereus.cost.moe import all_to_all_time, experts_hit
from nereus.cost.stages import stage_cost
from nereus.planner.search import search
from nereus.spec.job import load_job
from nereus.spec.layout import Layout, ModelStage
from tests.conftest import EXAMPLES

TRAINING = ModelStage("actor", "training")


def test_experts_hit_is_b_times_k_for_a_small_batch_and_saturates_at_the_expert_count() -> None:
    assert experts_hit(128, 8, 0) == 0.0
    assert experts_hit(128, 8, 1) == pytest.approx(8)  # one token: its k experts
    assert experts_hit(128, 8, 2) == pytest.approx(16, rel=0.05)  # few overlaps yet
    assert experts_hit(128, 8, 100_000) == pytest.approx(128)
    hits = [experts_hit(128, 8, b) for b in (1, 4, 16, 64, 256, 1024)]
    assert hits == sorted(hits) and all(h <= 128 for h in hits)


def test_training_memory_per_rank_falls_with_ep() -> None:
    job = load_job(EXAMPLES / "qwen3_30b_a3b_grpo.yaml")
    hw = Hardware(job.cluster)
    resident = [stage_cost(hw, job, TRAINING, Layout(dp=8, ep=ep)).resident_bytes for ep in (1, 2, 4, 8)]
    assert all(later < earlier for earlier, later in zip(resident, resident[1:], strict=False))
    # the experts are ~95% of Qwen3-30B-A3B's parameters; their Adam state, sharded over dp=8 by ZeRO-1 at
    # ep=1, has only dp / ep = 1 rank to shard over at ep=8, so the total falls ~3x rather than ~8x
    assert resident[-1] < resident[0] / 2.5


def test_a_dense_model_prices_identically_whatever_ep() -> None:
    job = load_job(EXAMPLES / "grpo_7b_h100.yaml")
    hw = Hardware(job.cluster)
    for ms in job.model_stages():
        plain, with_ep = (stage_cost(hw, job, ms, Layout(dp=8, ep=ep)) for ep in (1, 4))
        assert plain.terms == with_ep.terms and plain.resident_bytes == with_ep.resident_bytes, ms
    fixed = replace(job, options=replace(job.options, ep=4))
    chosen, plain_plan = search(hw, fixed), search(hw, job)
    assert chosen.plan == plain_plan.plan and chosen.estimate.step_time_s == plain_plan.estimate.step_time_s


def test_all_to_all_beyond_a_node_crosses_the_slower_link() -> None:
    job = load_job(EXAMPLES / "qwen3_30b_a3b_grpo.yaml")  # 8 GPUs a node
    hw = Hardware(job.cluster)
    gpu, p, nbytes = hw.cluster.gpu, hw.priors, 1e9  # large: the links, not the latency
    in_node = all_to_all_time(hw, nbytes, 8, 1)
    two_nodes = all_to_all_time(hw, nbytes, 16, 1)
    assert in_node == pytest.approx(7 / 8 * nbytes / (gpu.intra_node_bytes_per_s * p.intra_link_efficiency), rel=0.05)
    assert two_nodes >= 8 / 16 * nbytes / (gpu.inter_node_bytes_per_s * p.inter_link_efficiency)
    assert two_nodes > 2 * in_node
    assert all_to_all_time(hw, nbytes, 8, 2) > all_to_all_time(hw, nbytes, 4, 2)  # tp=2: ep=8 spans two nodes
    assert all_to_all_time(hw, nbytes, 1, 1) == 0.0
