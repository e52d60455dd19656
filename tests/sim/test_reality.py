"""The simulator truth's structural terms (``sim.reality``): the driver's pass and stragglers."""

from __future__ import annotations

import numpy as np
import pytest

from nereus.control.backend import RunToEnd
from nereus.cost.controller import controller_time
from nereus.cost.hardware import Hardware
from nereus.planner.search import search
from nereus.sim.backend import SimBackend, TruthConfig
from nereus.sim.reality import NO_REALITY, Reality, apply_reality, gpu_slowness, straggler_factor
from nereus.spec.job import job_from_dict
from nereus.spec.trace import LengthPoint, Trace


def _job():
    return job_from_dict({
        "name": "grpo-small", "models": {"actor": {"preset": "qwen2.5-0.5b"}},
        "algorithm": {"name": "grpo", "samples_per_prompt": 4},
        "workload": {"prompts_per_step": 64, "prompt_length": 256, "response_length": {"mean": 512, "max": 2048}},
        "cluster": {"gpu": "H100", "nodes": 1, "gpus_per_node": 8}})


def test_each_gpu_keeps_its_speed_for_the_cluster() -> None:
    a, b = gpu_slowness(0, 4096, 0.02), gpu_slowness(0, 4096, 0.02)
    assert np.array_equal(a, b) and not np.array_equal(a, gpu_slowness(1, 4096, 0.02))
    assert a.mean() == pytest.approx(1.0, abs=0.002)
    assert 1.05 < a.max() < 1.12  # the slowest of thousands, about 3.3 sigma out
    assert np.array_equal(gpu_slowness(0, 8, 0.0), np.ones(8))


def test_a_stage_runs_at_its_slowest_gpus_pace() -> None:
    slowness = np.array([1.0, 1.3, 0.9, 1.1])
    assert straggler_factor(slowness, (0, 2)) == 1.0
    assert straggler_factor(slowness, (0, 1, 2, 3)) == 1.3


def test_every_stage_call_pays_the_driver_and_its_slowest_gpu() -> None:
    job = _job()
    plan = search(Hardware(job.cluster), job).plan
    stages = {str(p.model_stage): 10.0 for p in plan.placements}
    phases = {"generation": 10.0, "inference": 10.0, "training": 10.0, "weight_sync": 1.0}
    slowness = np.full(8, 1.1)
    added = apply_reality(Reality(), slowness, plan, job, 2048, stages, phases)
    moved = controller_time(job.sequences_per_step(), 256 + 2048)
    assert added.driver_s == pytest.approx(moved)
    assert all(t == pytest.approx(11.0 + moved) for t in stages.values())
    assert phases["generation"] == pytest.approx(11.0 + moved) and phases["weight_sync"] == 1.0
    bare_stages, bare_phases = {k: 10.0 for k in stages}, dict.fromkeys(phases, 10.0)
    apply_reality(NO_REALITY, np.ones(8), plan, job, 2048, bare_stages, bare_phases)
    assert set(bare_stages.values()) == {10.0} and set(bare_phases.values()) == {10.0}


def test_the_truth_is_slower_than_the_cost_models_own_by_the_structural_terms() -> None:
    job = _job()
    plan = search(Hardware(job.cluster), job).plan
    trace = Trace("t", "test", 2, 0.6, (LengthPoint(0, 512, 2048),))
    real = SimBackend(job, trace, 0).run_step(plan, 0, RunToEnd())
    bare = SimBackend(job, trace, 0, TruthConfig(reality=NO_REALITY)).run_step(plan, 0, RunToEnd())
    moved = real.detail["driver_s"]
    assert moved == pytest.approx(controller_time(job.sequences_per_step(), 256 + 2048))
    for name, seconds in bare.stage_times_s.items():
        if seconds > 0:
            assert real.stage_times_s[name] >= seconds + moved
    assert real.step_time_s > bare.step_time_s
