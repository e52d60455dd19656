"""Expert parallelism as a plan dimension: the planner proposes ep where the model has experts and the runtime
allows it (``spec.capability``), chooses it per model-stage of an MoE job, and ep > 1 where the experts do not
fit otherwise."""

from dataclasses import replace

from nereus.cost.hardware import Hardware
from nereus.planner.candidates import enumerate_layouts, ep_degrees
from nereus.planner.search import Constraints, search
from nereus.runtime.capability import CAPABILITY
from nereus.spec import job_from_dict
from nereus.spec.capability import RuntimeCapability
from nereus.spec.job import load_job
from nereus.spec.layout import Layout, ModelStage
from tests.conftest import EXAMPLES


def _job(gpus: int):
    return load_job(EXAMPLES / "qwen3_30b_a3b_grpo.yaml").with_gpus(gpus)


def test_ep_degrees_divide_dp_and_the_experts_and_a_dense_model_has_none():
    job = _job(64)
    assert ep_degrees(job, "actor", 16) == [1, 2, 4, 8, 16]
    assert ep_degrees(job, "actor", 6) == [1, 2]  # 3 and 6 do not divide 128 experts
    dense = load_job(EXAMPLES / "grpo_7b_h100.yaml")
    assert ep_degrees(dense, "actor", 16) == [1]
    fixed = replace(job, options=replace(job.options, ep=4))
    assert ep_degrees(fixed, "actor", 16) == [4] and ep_degrees(fixed, "actor", 2) == [1]
    training = ModelStage("actor", "training")
    assert {lay.ep for lay in enumerate_layouts(job, training, 64)} == {1, 2, 4, 8, 16, 32, 64}
    narrowed = RuntimeCapability().planning_options(job.options)  # a runtime without expert parallelism
    assert {lay.ep for lay in enumerate_layouts(replace(job, options=narrowed), training, 64)} == {1}


def test_training_that_needs_the_experts_split_gets_ep():
    job = job_from_dict({"models": {"m": {"preset": "qwen3-235b-a22b"}}, "algorithm": {"name": "train"},
                         "workload": {"global_batch": 256, "sequence_length": 4096},
                         "cluster": {"gpu": "H100", "nodes": 16, "gpus_per_node": 8}})
    result = search(Hardware(job.cluster), job)  # 128 H100s: the experts fit only split over ep ranks
    layout = result.plan.placements[0].layout
    assert result.estimate.feasible and layout.ep > 1 and layout.dp % layout.ep == 0


def test_the_plan_of_qwen3_30b_a3b_chooses_ep_per_stage():
    chosen = {}
    for gpus in (64, 1024):
        job = _job(gpus)
        result = search(Hardware(job.cluster), job)
        assert result.estimate.feasible
        chosen[gpus] = {str(p.model_stage): p.layout for p in result.plan.placements}
        searched = {lay.ep for ms in job.model_stages() for lay in enumerate_layouts(job, ms, gpus)}
        assert searched >= {1, 2, 8}, gpus  # every stage's candidates carry the ep degrees
        assert all(lay.dp % lay.ep == 0 for lay in chosen[gpus].values())
    assert any(lay.ep > 1 for lay in chosen[64].values())  # generation at 64 GPUs: EP pays (docs/moe.md)


def test_the_runtime_runs_ep_in_inference_and_training_only_and_not_with_fsdp():
    assert CAPABILITY.supports(Layout(dp=2, ep=2), "training") == []
    assert CAPABILITY.supports(Layout(dp=2, ep=2), "inference") == []
    assert "in generation" in CAPABILITY.supports(Layout(dp=2, ep=2), "generation")[0]
    assert "with fsdp" in CAPABILITY.supports(Layout(dp=2, ep=2, fsdp=True, zero1=False), "training")[0]
    job = _job(64)
    planned = search(Hardware(job.cluster), job, constraints=Constraints(capability=CAPABILITY)).plan
    gen = [p.layout for p in planned.placements if p.model_stage.stage == "generation"]
    assert gen and all(lay.ep == 1 for lay in gen)
