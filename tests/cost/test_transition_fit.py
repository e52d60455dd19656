"""The fixed part of a transition: priced by ``TransitionFit``, fitted to measured moves, and used by
the controller's admission test after the first transition it measured."""

import pytest

from nereus.control.backend import TransitionMetrics
from nereus.control.controller import Controller, ControllerConfig
from nereus.control.forecast import LengthSchedule
from nereus.control.transition_cost import TransitionCoster
from nereus.cost.hardware import Hardware
from nereus.cost.transition import TransitionCalibrator, TransitionFit, engines_rebuilt, moved_stages
from nereus.spec import job_from_dict


def small_job(priors: dict | None = None):
    cluster = {"gpu": "H100", "memory_gb": 80, "nodes": 1, "gpus_per_node": 8, **({"priors": priors} if priors else {})}
    return job_from_dict({
        "name": "ppo-small",
        "models": {m: {"preset": "qwen2.5-0.5b"} for m in ("actor", "critic", "reference", "reward")},
        "algorithm": {"name": "ppo", "mini_batches": 2},
        "workload": {"prompts_per_step": 256, "prompt_length": 256, "response_length": {"mean": 512, "max": 2048}},
        "cluster": cluster,
    })


def _moved_plan(plan):
    from dataclasses import replace

    p = plan.placements[0]
    layout = replace(p.layout, micro_batch_size=p.layout.micro_batch_size + 1)
    return replace(plan, placements=(replace(p, layout=layout), *plan.placements[1:]))


def test_fit_recovers_the_fixed_and_per_stage_parts_of_synthetic_moves():
    """Measured = 1.3 x bandwidth + 0.5 s + 0.2 s per stage: the fit finds all three (the rows vary the
    bandwidth and the stage count, so the terms are identifiable)."""
    cal = TransitionCalibrator()
    for bandwidth, stages in [(0.1, 1), (2.0, 1), (0.5, 3), (4.0, 2), (0.0, 4), (1.0, 2)]:
        cal.observe(bandwidth, stages, 1.3 * bandwidth + 0.5 + 0.2 * stages)
    assert cal.fit.bytes_factor == pytest.approx(1.3, rel=1e-2)
    assert cal.fit.fixed_s == pytest.approx(0.5, rel=2e-2)
    assert cal.fit.per_stage_s == pytest.approx(0.2, rel=5e-2)
    assert max(map(abs, cal.relative_errors())) < 1e-2


def test_one_kind_of_move_is_predicted_right_and_nothing_moved_costs_nothing():
    """A CPU run whose moves transfer almost no bytes: the fixed part carries the whole time."""
    cal = TransitionCalibrator()
    for measured in (0.52, 0.61, 0.48):
        cal.observe(1e-4, 2, measured)
    assert cal.fit.seconds(1e-4, 2) == pytest.approx(0.537, rel=0.05)
    assert cal.fit.seconds(0.0, 0) == 0.0
    assert cal.observe(0.1, 0, 9.0) == cal.fit  # a move of no model-stage is not a row
    assert len(cal.rows) == 3


def test_prior_comes_from_the_cluster_priors_and_is_the_fit_before_any_move():
    job = small_job({"transition_fixed_s": 0.7, "transition_per_stage_s": 0.1})
    fit = TransitionFit.prior(Hardware(job.cluster))
    assert (fit.fixed_s, fit.per_stage_s) == (0.7, 0.1)
    assert fit.seconds(1.0, 2) == pytest.approx(1.9)
    # bytes only by default, besides the start of rollout engines a move rebuilds (vLLM's prior)
    assert TransitionFit.prior(Hardware(small_job().cluster)) == TransitionFit(engine_start_s=34.0)


def test_controller_prices_the_fixed_part_it_measured():
    """Before any transition the cost is the bandwidth-bound time; after one measured move that took
    3 s more, the same move's predicted cost carries those seconds."""
    job = small_job()
    ctl = Controller(job, ControllerConfig(calibrate=True), LengthSchedule(default_max=2048))
    ctl.initial_plan(8)
    cand = _moved_plan(ctl.plan)
    assert moved_stages(ctl.plan, cand) == 1
    coster = ctl.transition_cost
    assert isinstance(coster, TransitionCoster)
    bandwidth = coster.scheduled(ctl.hw, job, ctl.plan, cand)
    before = coster(ctl.hw, job, ctl.plan, cand)
    assert before == pytest.approx(bandwidth)
    ctl.transition_done(ctl.plan, cand, TransitionMetrics(bandwidth + 3.0, bandwidth, 1e9))
    after = coster(ctl.hw, job, ctl.plan, cand)
    assert after == pytest.approx(bandwidth + 3.0, rel=0.02)
    assert coster.quick(ctl.hw, job, ctl.plan, cand) > 2.9  # the screen sees it too
    assert coster(ctl.hw, job, ctl.plan, ctl.plan) == 0.0


def test_without_calibration_transitions_stay_at_their_priors():
    """``calibrate: false`` decides on the priors alone: a measured transition changes no price."""
    job = small_job()
    ctl = Controller(job, ControllerConfig(calibrate=False), LengthSchedule(default_max=2048))
    ctl.initial_plan(8)
    cand = _moved_plan(ctl.plan)
    before = ctl.transition_cost(ctl.hw, job, ctl.plan, cand)
    ctl.transition_done(ctl.plan, cand, TransitionMetrics(before + 3.0, before, 1e9))
    assert ctl.transition_cost(ctl.hw, job, ctl.plan, cand) == before


def _vllm(job):
    """``job`` generating with vLLM (set directly: the installed-engine check is the spec's, not this)."""
    from dataclasses import replace

    from nereus.spec.rollout import RolloutEngine
    from nereus.spec.run import RunSpec

    return replace(job, run=RunSpec(rollout_engine=RolloutEngine(engine="vllm")))


def _generation_moved(plan):
    """``plan`` with the generation stage of the actor at another TP (its devices kept)."""
    from dataclasses import replace

    i, p = next((i, p) for i, p in enumerate(plan.placements) if p.model_stage.stage == "generation")
    tp = 1 if p.layout.tp > 1 else 2
    layout = replace(p.layout, tp=tp, dp=p.layout.tp * p.layout.dp // tp)
    return replace(plan, placements=(*plan.placements[:i], replace(p, layout=layout), *plan.placements[i + 1:]))


def test_a_move_of_a_vllm_generation_stage_rebuilds_one_engine_per_replica():
    job = small_job()
    ctl = Controller(job, ControllerConfig(calibrate=False), LengthSchedule(default_max=2048))
    plan = ctl.initial_plan(8)
    moved = _generation_moved(plan)
    gen = next(p for p in moved.placements if p.model_stage.stage == "generation")
    assert engines_rebuilt(_vllm(job), plan, moved) == gen.layout.dp
    assert engines_rebuilt(job, plan, moved) == 0  # the native engine is the workers' own: nothing to start
    from dataclasses import replace

    i, p = next((i, p) for i, p in enumerate(plan.placements) if p.model_stage.stage == "training")
    layout = replace(p.layout, micro_batch_size=p.layout.micro_batch_size + 1)
    training_moved = replace(plan, placements=(*plan.placements[:i], replace(p, layout=layout),
                                               *plan.placements[i + 1:]))
    assert engines_rebuilt(_vllm(job), plan, training_moved) == 0  # generation did not move
    assert engines_rebuilt(_vllm(job), plan, plan) == 0


def _with_generation(plan, layout, gpus):
    from dataclasses import replace

    i, p = next((i, p) for i, p in enumerate(plan.placements) if p.model_stage.stage == "generation")
    return replace(plan, placements=(*plan.placements[:i], replace(p, layout=layout, gpus=tuple(gpus)),
                                     *plan.placements[i + 1:]))


def test_a_device_that_keeps_an_engine_of_the_same_tp_starts_none():
    """Engines are kept where a replica's engine device (its TP rank 0) held one of the same TP size
    (``runtime.engines.pool``): only the other replicas start one."""
    from nereus.spec.layout import Layout

    job = _vllm(small_job())
    plan = Controller(job, ControllerConfig(calibrate=False), LengthSchedule(default_max=2048)).initial_plan(8)
    four = _with_generation(plan, Layout(tp=2, dp=4), range(8))  # engines on devices 0, 2, 4, 6
    assert engines_rebuilt(job, four, _with_generation(plan, Layout(tp=2, dp=2), [0, 1, 4, 5])) == 0
    assert engines_rebuilt(job, four, _with_generation(plan, Layout(tp=2, dp=2), [1, 0, 4, 5])) == 1  # 1 heads
    assert engines_rebuilt(job, four, _with_generation(plan, Layout(tp=1, dp=4), [0, 2, 4, 6])) == 4  # TP changed
    two = _with_generation(plan, Layout(tp=2, dp=2), [0, 1, 2, 3])
    assert engines_rebuilt(job, two, _with_generation(plan, Layout(tp=2, dp=4), range(8))) == 2  # 4 and 6 new


def test_engine_start_is_priced_and_fitted_apart_from_the_other_fixed_parts():
    """Measured = bandwidth + 0.5 s + 12 s when the move rebuilds engines: the fit finds the engine start
    (moves with and without engines make it identifiable), and the controller's price carries the prior
    before any measured rebuild."""
    cal = TransitionCalibrator(TransitionFit(engine_start_s=34.0))
    for bandwidth, stages, engines in [(0.1, 1, 0), (2.0, 2, 2), (0.5, 3, 0), (4.0, 1, 1), (0.0, 2, 4), (1.0, 1, 0)]:
        cal.observe(bandwidth, stages, bandwidth + 0.5 + 12.0 * (engines > 0), engines)
    assert cal.fit.engine_start_s == pytest.approx(12.0, rel=2e-2)
    assert cal.fit.fixed_s == pytest.approx(0.5, rel=0.1)
    assert max(map(abs, cal.relative_errors())) < 2e-2
    job = _vllm(small_job())
    ctl = Controller(job, ControllerConfig(calibrate=True), LengthSchedule(default_max=2048))
    ctl.initial_plan(8)
    moved = _generation_moved(ctl.plan)
    bandwidth = ctl.transition_cost.scheduled(ctl.hw, job, ctl.plan, moved)
    assert ctl.transition_cost(ctl.hw, job, ctl.plan, moved) == pytest.approx(bandwidth + 34.0)
    ctl.transition_done(ctl.plan, moved, TransitionMetrics(bandwidth + 9.0, bandwidth, 1e9))
    assert ctl.transition_cost(ctl.hw, job, ctl.plan, moved) == pytest.approx(bandwidth + 9.0, rel=0.02)
