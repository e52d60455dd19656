"""Expert parallelism as a plan dimension: the planner proposes ep where the model has experts and the
runtime allows it, and chooses ep > 1 where the experts do not fit otherwise."""

from dataclasses import replace

from nereus.cost.hardware import Hardware
from nereus.planner.candidates import enumerate_layouts
from nereus.planner.search import search
from nereus.spec import job_from_dict, load_job
from nereus.spec.capability import RuntimeCapability
from nereus.spec.job import JobSpec
from nereus.spec.layout import ModelStage


def _train_job(preset: str, nodes: int) -> JobSpec:
    return job_from_dict({"models": {"m": {"preset": preset}}, "algorithm": {"name": "train"},
                          "workload": {"global_batch": 256, "sequence_length": 4096},
                          "cluster": {"gpu": "H100", "nodes": nodes, "gpus_per_node": 8}})


def test_training_that_needs_the_experts_split_gets_ep():
    job = _train_job("qwen3-235b-a22b", 16)  # 128 H100s: the experts fit only split over ep ranks
    result = search(Hardware(job.cluster), job)
    layout = result.plan.placements[0].layout
    assert result.estimate.feasible and layout.ep > 1
    assert layout.dp % layout.ep == 0 and 128 % layout.ep == 0


def test_ep_enumerated_for_moe_only_and_behind_the_capability(examples):
    job = load_job(examples / "qwen3_30b_a3b_grpo.yaml")
    ms = ModelStage("actor", "training")
    eps = {lay.ep for lay in enumerate_layouts(job, ms, 64)}
    assert eps == {1, 2, 4, 8, 16, 32, 64}
    assert {lay.ep for lay in enumerate_layouts(job, ModelStage("actor", "generation"), 64)} > {1}
    narrowed = RuntimeCapability().planning_options(job.options)
    assert {lay.ep for lay in enumerate_layouts(replace(job, options=narrowed), ms, 64)} == {1}
    dense = load_job(examples / "grpo_7b_h100.yaml")
    assert {lay.ep for lay in enumerate_layouts(dense, ms, 32)} == {1}
    assert RuntimeCapability().supports(replace(next(iter(enumerate_layouts(job, ms, 64))), ep=2))
