"""The runtime's capability (``spec.capability``): which layouts it runs, why not, and the planner never
proposing one it cannot run."""

from __future__ import annotations

from dataclasses import replace

import pytest

from nereus.cost.hardware import Hardware
from nereus.planner.search import Constraints, search
from nereus.runtime.capability import CAPABILITY
from nereus.spec.capability import RuntimeCapability, UnsupportedLayout
from nereus.spec.job import Options, load_job
from nereus.spec.layout import Layout
from tests.conftest import EXAMPLES

PLAIN = Layout(tp=2, pp=2, recompute="none", sequence_parallel=False)


def test_supports_names_each_field_and_fix():
    assert CAPABILITY.supports(PLAIN) == []
    assert all(CAPABILITY.supports(replace(PLAIN, recompute=r)) == [] for r in ("selective", "full"))
    assert CAPABILITY.supports(replace(PLAIN, fsdp=True, zero1=False)) == []  # ZeRO-3 (``parallel.zero3``)
    bad = replace(PLAIN, sequence_parallel=True, interleave=2, fsdp=True)
    older = RuntimeCapability(recompute=("none",))
    reasons = older.supports(bad, "training")
    assert len(reasons) == 3
    for field, fix in (("sequence_parallel", "sequence_parallel=false"), ("interleave", "interleave=1"),
                       ("fsdp", "fsdp=false")):
        assert any(r.startswith(field) and fix in r for r in reasons), (field, reasons)
    with pytest.raises(UnsupportedLayout, match="fsdp"):
        older.as_run(bad)
    with pytest.raises(UnsupportedLayout, match="interleave"):
        CAPABILITY.as_run(bad)
    assert older.supports(replace(PLAIN, recompute="full")) == [
        "recompute='full': the runtime implements ['none']; set recompute=none"]
    assert older.planning_options(Options(recompute="auto")).recompute == "none"
    assert CAPABILITY.planning_options(Options(recompute="auto")).recompute == "auto"  # the planner chooses


def test_options_that_change_nothing_run_with_them_off():
    """Recompute and sequence parallelism outside training, or SP over one TP rank, change nothing."""
    inference = replace(PLAIN, recompute="selective", sequence_parallel=True)
    assert CAPABILITY.supports(inference, "inference") == []
    assert CAPABILITY.as_run(inference, "inference") == PLAIN
    assert CAPABILITY.supports(inference, "training") != []
    one_tp = Layout(dp=2, recompute="none", sequence_parallel=True)
    assert CAPABILITY.as_run(one_tp) == replace(one_tp, sequence_parallel=False)
    richer = RuntimeCapability(recompute=("none", "full"), sequence_parallel=True, max_interleave=2)
    assert richer.supports(replace(PLAIN, recompute="full", sequence_parallel=True, interleave=2)) == []


def test_planner_under_the_capability_proposes_only_runnable_layouts():
    """The 8B example's options ask for recompute and SP; under the capability every proposed layout
    runs, for a job whose own options the capability narrows."""
    job = load_job(EXAMPLES / "ppo_8b_h100.yaml")
    assert job.options.recompute == "selective" and job.options.sequence_parallel
    narrowed = replace(job, options=CAPABILITY.planning_options(job.options))
    assert not narrowed.options.concurrent_stages and narrowed.options.interleave == 1
    plan = search(Hardware(narrowed.cluster), narrowed, constraints=Constraints(capability=CAPABILITY)).plan
    for p in plan.placements:
        assert CAPABILITY.supports(p.layout, p.model_stage.stage) == [], (p.model_stage, p.layout)
    seen = []
    Constraints(layout_filter=lambda ms, lay: seen.append(lay) or True, capability=CAPABILITY).layout_filter(
        plan.placements[0].model_stage, PLAIN)
    assert seen == [PLAIN]  # a caller's own filter still applies


def test_with_run_overlap_the_controller_prices_a_phase_at_its_slowest_disjoint_group(tmp_path):
    """``run.overlap`` runs the model-stages of a phase on disjoint workers at once: the controller's job
    then prices such a phase at its slowest group (``capability_for``), without it at their sum."""
    from nereus.control.tail_policy import padded_rest
    from nereus.cost.plan_cost import estimate_plan
    from nereus.run.adaptive import controller_for, plan_of
    from nereus.run.setup import place
    from nereus.runtime.capability import capability_for
    from tests.run.jobs import tiny_job

    assert capability_for(True).concurrent_stages and not capability_for(False).concurrent_stages
    rests, phases = {}, {}
    for overlap in (False, True):
        job = tiny_job("grpo", str(tmp_path), overlap=overlap)
        ctrl = controller_for(job)
        assert ctrl.job.options.concurrent_stages is overlap
        plan = plan_of(place(job), job.run.workers)
        est = estimate_plan(Hardware(ctrl.job.cluster), ctrl.job, plan)
        inference = [est.costs[str(p.model_stage)].time({}) for p in plan.placements
                     if p.model_stage.stage == "inference"]
        phases[overlap] = (est.phase_times["inference"], inference)
        rests[overlap] = padded_rest(ctrl.job, plan, {}).seconds
    (alone, stages), (together, same) = phases[False], phases[True]
    assert stages == same and len(stages) == 2  # the actor's and the reference's, on disjoint workers
    assert alone == pytest.approx(sum(stages)) and together == pytest.approx(max(stages))
    assert rests[True] == pytest.approx(rests[False] - min(stages))


def _train_job(memory_gb: float):
    from nereus.spec import job_from_dict

    arch = {"layers": 8, "hidden": 1024, "ffn_hidden": 4096, "heads": 16, "kv_heads": 16, "vocab": 32000}
    return job_from_dict({
        "name": "recompute-fits", "models": {"actor": arch}, "algorithm": {"name": "train", "models": ["actor"]},
        "workload": {"global_batch": 8, "sequence_length": 4096},
        "cluster": {"gpu": {"name": "small", "peak_tflops": 100, "hbm_tb_per_s": 1, "memory_gb": memory_gb,
                            "intra_node_gb_per_s": 100, "inter_node_gb_per_s": 10}, "nodes": 1, "gpus_per_node": 1},
        "options": {"recompute": "auto", "sequence_parallel": False, "micro_batch_size": 8}})


def test_the_planner_recomputes_under_the_capability_where_memory_requires_it():
    """With options.recompute: auto the runtime's planner prices each training layout's memory: no
    recomputation where the step fits without (it is faster), full recomputation on a device only it fits."""
    from nereus.cost.stages import training_cost
    from nereus.spec.layout import ModelStage

    def choice(memory_gb: float) -> str:
        job = _train_job(memory_gb)
        job = replace(job, options=CAPABILITY.planning_options(job.options))
        plan = search(Hardware(job.cluster), job, constraints=Constraints(capability=CAPABILITY)).plan
        return plan.placement("actor/training").layout.recompute

    job, ms = _train_job(1000), ModelStage("actor", "training")
    peak = {r: training_cost(Hardware(job.cluster), job, ms, Layout(micro_batch_size=8, recompute=r,
                                                                       sequence_parallel=False)).peak_bytes
            for r in ("none", "full")}
    assert peak["full"] < peak["none"] - 5e9  # 4k-token sequences: activations dominate
    assert choice(1000) == "none"
    # 2 GB of the device reserved (Hardware.usable_bytes): room for full recomputation's step, not the others'
    assert choice((peak["full"] + peak["none"]) / 2 / 1e9 + 2) == "full"
