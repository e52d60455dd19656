"""The vLLM engine's weight reload in the sync phase (``cost.weight_sync.engine_reload_time``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from nereus.cost.calibration import Calibrator
from nereus.cost.hardware import Hardware
from nereus.cost.plan_cost import estimate_plan
from nereus.cost.weight_sync import checkpoint_tensors, engine_reload_time
from nereus.spec.layout import Layout
from nereus.spec.rollout import RolloutEngine
from tests.run.jobs import tiny_job


def jobs(tmp_path):
    native = tiny_job("grpo", str(tmp_path))
    vllm = replace(native, run=replace(native.run, rollout_engine=RolloutEngine(engine="vllm")))
    return native, vllm


def plan_of(job):
    from nereus.run.adaptive import plan_of as of
    from nereus.run.setup import place

    return of(place(job), job.run.workers)


def test_the_reload_adds_to_the_sync_phase_of_a_vllm_job(tmp_path):
    native, vllm = jobs(tmp_path)
    hw = Hardware(native.cluster)
    plan = plan_of(native)
    gen = plan.placement(next(p.model_stage for p in plan.placements if str(p.model_stage) == "actor/generation"))
    extra = engine_reload_time(hw, vllm, gen.layout)
    assert extra > 0
    assert estimate_plan(hw, vllm, plan).phase_times["weight_sync"] == pytest.approx(
        estimate_plan(hw, native, plan).phase_times["weight_sync"] + extra)


def test_tensor_count_and_tp_split_the_memory_term(tmp_path):
    _, vllm = jobs(tmp_path)
    assert checkpoint_tensors(vllm) == 2 * 9 + 3  # two layers, embedding, final norm, untied head
    hw = Hardware(vllm.cluster)
    one, two = engine_reload_time(hw, vllm, Layout(tp=1)), engine_reload_time(hw, vllm, Layout(tp=2))
    assert two < one


def test_calibration_scales_the_measured_sync_with_the_reload(tmp_path):
    _, vllm = jobs(tmp_path)
    hw, plan = Hardware(vllm.cluster), plan_of(vllm)
    predicted = estimate_plan(hw, vllm, plan).phase_times["weight_sync"]
    cal = Calibrator(hw)
    for _ in range(3):
        cal.observe(vllm, plan, {"weight_sync": 2 * predicted})
    factors = cal.fit()
    assert cal.predict(vllm, plan).phase_times["weight_sync"] == pytest.approx(2 * predicted, rel=1e-3)
    assert factors["sync"] == pytest.approx(2.0, rel=1e-3)
