"""The GPU-seconds a simulated step's work holds, and the balanced bound the run summary derives from them:
no schedule of a step's work beats it, and a one-step-off plan counts each pool for its own phases."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereus.control.pools import runs_one_step_off
from nereus.control.record import balanced_summary
from nereus.cost.generation import ROLLOUT
from nereus.sim.run import simulate
from nereus.spec import load_job
from nereus.spec.layout import Plan
from nereus.spec.trace import load_trace

ROOT = Path(__file__).resolve().parents[2]


def _run(policy: str, lag: int):
    job = load_job(ROOT / "examples" / "grpo_7b_h100.yaml")
    trace = load_trace(ROOT / "traces" / "r1_zero_growth.yaml")
    return simulate(job, trace, policy, seed=0, steps=3, policy_lag=lag)


@pytest.mark.parametrize("policy,lag", [("nereus", 1), ("verl-like", 0)])
def test_busy_seconds_follow_each_pool_and_bound_the_step(policy: str, lag: int) -> None:
    record = _run(policy, lag)
    plan = Plan.from_dict(record.plans[-1]["plan"])
    split = runs_one_step_off(plan)
    assert split == (policy == "nereus")  # the split this job's lag-1 run starts on (its generation dominates)
    n = plan.num_gpus
    for s in record.steps:
        p, idle = s["phases"], s["generation"]["idle_gpu_s"]
        if split:
            g = len(plan.placement(ROLLOUT).gpus)
            held = g * p["generation"] + (n - g) * (p["inference"] + p["training"])
        else:
            held = n * (p["generation"] + p["inference"] + p["training"])
        assert s["busy_gpu_s"] == pytest.approx(held + n * p["weight_sync"] - idle)
        gen_gpus = len(plan.placement(ROLLOUT).gpus) if split else n
        assert s["busy_generation_gpu_s"] == pytest.approx(gen_gpus * p["generation"] - idle)
        assert 0 < s["busy_gpu_s"] <= n * s["step_time_s"] * (1 + 1e-9)
    summary = record.summary()
    assert summary["balanced_step_s"] <= summary["mean_step_s"]
    assert summary["balanced_tokens_per_s"] >= summary["tokens_per_s"]
    assert summary["balanced_generation_s"] + summary["balanced_rest_s"] == pytest.approx(summary["balanced_step_s"])
    assert 0 < summary["balanced_generation_s"] < summary["balanced_step_s"]
    if split:  # the pools' phases differ, so balancing them would gain something
        assert summary["balanced_step_s"] < summary["mean_step_s"]


def test_the_balanced_figures_split_generation_from_the_rest_and_need_every_step() -> None:
    step = {"gpus": 8, "transition_s": 0.0, "lost_s": 0.0, "busy_gpu_s": 80.0, "busy_generation_gpu_s": 48.0}
    assert balanced_summary([step, {**step, "busy_gpu_s": 40.0, "busy_generation_gpu_s": 16.0}], 150.0) == {
        "balanced_step_s": 7.5, "balanced_tokens_per_s": 10.0, "balanced_generation_s": 4.0, "balanced_rest_s": 3.5}
    assert balanced_summary([step, {k: v for k, v in step.items() if k != "busy_gpu_s"}], 1.0) == {}
    assert balanced_summary([step, {k: v for k, v in step.items() if k != "busy_generation_gpu_s"}], 1.0) == {}
    assert balanced_summary([], 1.0) == {}
