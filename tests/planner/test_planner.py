import pytest
from hypothesis import given
from hypothesis import strategies as st

from nereus.cost.hardware import Hardware
from nereus.cost.plan_cost import estimate_plan
from nereus.planner.search import compositions, search, set_partitions
from nereus.spec import InfeasibleError, job_from_dict, load_job


def test_set_partitions_and_compositions():
    assert len(set_partitions(list("abcde"))) == 52  # Bell(5)
    assert len(set_partitions(list("abc"))) == 5
    assert compositions(4, 2) == [(1, 3), (2, 2), (3, 1)]


def test_ppo_8b_at_1024_gpus_is_feasible_and_explained(examples):
    job = load_job(examples / "ppo_8b_h100.yaml").with_gpus(1024)
    hw = Hardware(job.cluster)
    result = search(hw, job)
    assert result.estimate.feasible
    assert {str(p.model_stage) for p in result.plan.placements} == {str(m) for m in job.model_stages()}
    for p in result.plan.placements:
        assert len(p.gpus) == p.layout.world and max(p.gpus) < 1024
        assert p.layout.tp <= job.cluster.gpus_per_node
    again = estimate_plan(hw, job, result.plan)
    assert again.step_time_s == pytest.approx(result.estimate.step_time_s)
    assert max(again.device_peak_bytes) <= hw.usable_bytes()
    assert result.runners_up and all(r.step_time_s >= result.estimate.step_time_s for r in result.runners_up)


def test_70b_actor_on_one_a100_node_names_stage_memory_and_capacity(examples):
    job = load_job(examples / "ppo_70b_a100_one_node.yaml")
    with pytest.raises(InfeasibleError) as err:
        search(Hardware(job.cluster), job)
    assert err.value.model_stage == "actor/training"
    assert err.value.needed_bytes > err.value.capacity_bytes == 80e9
    assert "actor/training" in str(err.value) and "GB per device" in str(err.value) and "80.0 GB" in str(err.value)


def test_more_gpus_never_predict_a_slower_step(examples):
    job = load_job(examples / "grpo_7b_h100.yaml")
    times = [search(Hardware(j.cluster), j).estimate.step_time_s for j in (job.with_gpus(n) for n in (16, 32, 64))]
    assert times[0] >= times[1] >= times[2]


@given(model=st.sampled_from(["qwen2.5-0.5b", "llama3-8b"]), gpus=st.sampled_from([4, 8, 16, 32]),
       prompts=st.sampled_from([32, 128, 512]), mean=st.sampled_from([256, 1024, 4096]),
       algorithm=st.sampled_from(["ppo", "grpo"]), memory=st.sampled_from([24, 40, 80]))
def test_every_returned_plan_passes_its_feasibility_check(model, gpus, prompts, mean, algorithm, memory):
    models = ["actor", "critic", "reference", "reward"] if algorithm == "ppo" else ["actor", "reference"]
    job = job_from_dict({
        "models": {m: {"preset": model} for m in models},
        "algorithm": {"name": algorithm, "mini_batches": 2, "samples_per_prompt": 1 if algorithm == "ppo" else 4},
        "workload": {"prompts_per_step": prompts, "prompt_length": 256,
                     "response_length": {"mean": mean, "max": 4 * mean}},
        "cluster": {"gpu": "H100", "memory_gb": memory, "nodes": max(1, gpus // 8), "gpus_per_node": min(8, gpus)},
    })
    hw = Hardware(job.cluster)
    try:
        result = search(hw, job)
    except InfeasibleError as err:
        assert err.needed_bytes > 0 and err.capacity_bytes == memory * 1e9
        return
    check = estimate_plan(hw, job, result.plan)
    assert check.feasible, check.violations[:3]
    assert check.step_time_s == pytest.approx(result.estimate.step_time_s)


def test_stages_tied_at_the_largest_transient_still_swap_to_smaller_micro_batches(examples):
    # PPO 8B, 20,480-token responses, every stage FSDP on all 64 GPUs: actor and reference inference
    # both pick micro-batch 8 first (75 GB of logits and activations each); lowering one alone leaves the
    # peak, so a swap that only counted the peak found nothing and the search reported no layout.
    from dataclasses import replace

    from nereus.planner.search import Constraints
    from nereus.spec.response import ResponseLength

    job = load_job(examples / "ppo_8b_h100.yaml").with_response(ResponseLength(6000, 20480, "lognormal", 1.0))
    job = replace(job, options=replace(job.options, fsdp=True))

    def sharded(ms, layout):
        return ms.stage == "generation" or (layout.tp == layout.pp == 1 and layout.fsdp)

    result = search(Hardware(job.cluster), job, None, constraints=Constraints(("colocated",), sharded))
    assert estimate_plan(Hardware(job.cluster), job, result.plan).feasible
    inference = [p.layout.micro_batch_size for p in result.plan.placements
                 if p.model_stage.model in ("actor", "reference") and p.model_stage.stage == "inference"]
    assert inference and max(inference) < 8


def test_priced_per_pass_overhead_makes_the_planner_take_whole_mini_batches(examples):
    # The long-tail GRPO job on this machine's measured profile: 128 sequences a step, 2 mini-batches, so
    # each of 2 training replicas gets 32 rows per optimizer step. With a fixed cost per micro-batch pass
    # (CPU workers: Python dispatch), one pass of 32 beats four of 8; without it nothing favours fewer.
    import yaml

    from nereus.planner.candidates import MICRO_BATCH_SIZES

    spec = yaml.safe_load((examples / "grpo_longtail_tiny.yaml").read_text())
    spec["run"].pop("layouts")
    spec["run"]["adapt"] = {}

    def training_and_inference(priors: dict) -> list[int]:
        spec["cluster"] = {"profile": str(examples / "cpu-local.yaml"), "priors": priors}
        job = job_from_dict(spec)
        plan = search(Hardware(job.cluster), job).plan
        return [p.layout.micro_batch_size for p in plan.placements if p.model_stage.stage != "generation"]

    assert 32 in MICRO_BATCH_SIZES
    assert training_and_inference({"micro_batch_overhead_s": 0.003, "host_cores": 2}) == [32, 32, 32]
    assert max(training_and_inference({"micro_batch_overhead_s": 0.0, "host_cores": 2})) < 32


def test_the_planner_shards_weights_with_fsdp_where_only_that_fits(examples):
    # GRPO 7B on 32 GPUs of 40 GB with data-parallel-only training layouts (TP and PP would shard the weights
    # too): ZeRO-1 keeps 2 + 4 bytes of weights and gradients per parameter whole on every GPU (42 GB), so
    # training fits only with fsdp (18 bytes per parameter over 32 ranks). The plain planner and the one
    # for this runtime (its capability runs ZeRO-3) both choose it; a runtime without it has no plan.
    from dataclasses import replace

    from nereus.planner.search import Constraints
    from nereus.runtime.capability import CAPABILITY
    from nereus.spec.response import ResponseLength

    job = load_job(examples / "grpo_7b_h100.yaml").with_response(ResponseLength(1000, 2048, "lognormal", 0.8))
    job = replace(job, cluster=replace(job.cluster, gpu=replace(job.cluster.gpu, memory_bytes=40e9)),
                  options=replace(job.options, fsdp="auto"))

    def data_parallel(ms, layout):
        return ms.stage == "generation" or layout.tp == layout.pp == 1

    for capability in (None, CAPABILITY):
        planned = job if capability is None else replace(job, options=capability.planning_options(job.options))
        plan = search(Hardware(job.cluster), planned, None,
                      constraints=Constraints(("colocated",), data_parallel, capability)).plan
        training = [p.layout for p in plan.placements if p.model_stage.stage == "training"]
        assert training and all(lay.fsdp and not lay.zero1 for lay in training), training
        assert estimate_plan(Hardware(job.cluster), planned, plan).feasible
    without = replace(CAPABILITY, fsdp=False)
    with pytest.raises(InfeasibleError, match="actor/training"):
        search(Hardware(job.cluster), replace(job, options=without.planning_options(job.options)), None,
               constraints=Constraints(("colocated",), data_parallel, without))


def test_the_planner_recomputes_activations_where_only_that_fits(examples):
    # GRPO 7B with long responses (mean 6,000, up to 16,384 tokens) on 40 GB GPUs: no layout's activations fit
    # without recomputation (45.7 GB at best), so the planner for this runtime (its capability runs
    # selective and full recomputation) recomputes; a runtime without recomputation has no plan.
    from dataclasses import replace

    from nereus.planner.search import Constraints
    from nereus.runtime.capability import CAPABILITY
    from nereus.spec.response import ResponseLength

    job = load_job(examples / "grpo_7b_h100.yaml").with_response(ResponseLength(6000, 16384, "lognormal", 0.8))
    job = replace(job, cluster=replace(job.cluster, gpu=replace(job.cluster.gpu, memory_bytes=40e9)),
                  options=replace(job.options, recompute="auto"))
    planned = replace(job, options=CAPABILITY.planning_options(job.options))
    plan = search(Hardware(job.cluster), planned, None, constraints=Constraints(capability=CAPABILITY)).plan
    training = [p.layout for p in plan.placements if p.model_stage.stage == "training"]
    assert training and all(lay.recompute != "none" for lay in training), training
    assert estimate_plan(Hardware(job.cluster), planned, plan).feasible
    without = replace(CAPABILITY, recompute=("none",))
    with pytest.raises(InfeasibleError, match="actor/training"):
        search(Hardware(job.cluster), replace(job, options=without.planning_options(job.options)), None,
               constraints=Constraints(capability=without))
