import math
import random

import pytest

from nereus.cost.calibration import Calibrator, plain_equivalent
from nereus.cost.hardware import Hardware
from nereus.cost.plan_cost import estimate_plan
from nereus.cost.stages import TERMS, stage_cost
from nereus.planner.candidates import enumerate_layouts
from nereus.spec import Placement, Plan, SpecError
from tests.helpers import ppo_job


def random_plans(job, hw, count: int, rng: random.Random) -> list[Plan]:
    """Plans with every model-stage on all GPUs under a random valid layout."""
    n = job.cluster.num_gpus
    options = {}
    for ms in job.model_stages():
        costs = [stage_cost(hw, job, ms, lay) for lay in enumerate_layouts(job, ms, n)]
        options[ms] = [c.layout for c in costs if c is not None and math.isfinite(c.time())]
    plans: list[Plan] = []
    while len(plans) < count:
        plan = Plan(tuple(Placement(ms, rng.choice(opts), tuple(range(n))) for ms, opts in options.items()), n)
        if math.isfinite(estimate_plan(hw, job, plan).step_time_s):  # the rollout's KV cache fits beside the rest
            plans.append(plan)
    return plans


def test_fitted_factors_predict_unseen_plans_within_5_percent():
    rng = random.Random(7)
    job = ppo_job(16)
    hw = Hardware(job.cluster)
    planted = {f"{stage}.{term}": rng.uniform(0.5, 2.0)
               for stage in ("generation", "inference", "training") for term in TERMS}
    planted["sync"] = rng.uniform(0.5, 2.0)

    def measure(plan: Plan, noise: float) -> dict[str, float]:
        truth = estimate_plan(hw, job, plan, planted)
        out = {name: t * (1 + rng.gauss(0, noise)) for name, t in truth.stage_times.items()}
        if truth.phase_times["weight_sync"] > 0:
            out["weight_sync"] = truth.phase_times["weight_sync"] * (1 + rng.gauss(0, noise))
        return out

    seen, unseen = random_plans(job, hw, 16, rng), random_plans(job, hw, 16, rng)
    cal = Calibrator(hw)
    for plan in seen:
        cal.observe(job, plan, measure(plan, noise=0.02))
    cal.fit()
    worst_uncalibrated, worst = 0.0, 0.0
    for plan in unseen:
        truth = estimate_plan(hw, job, plan, planted)
        predicted = cal.predict(job, plan)
        prior = estimate_plan(hw, job, plan)
        for name, t in truth.stage_times.items():
            worst = max(worst, abs(predicted.stage_times[name] / t - 1))
            worst_uncalibrated = max(worst_uncalibrated, abs(prior.stage_times[name] / t - 1))
        worst = max(worst, abs(predicted.step_time_s / truth.step_time_s - 1))
    print(f"worst relative error on unseen plans: calibrated {worst:.3f}, uncalibrated {worst_uncalibrated:.3f}")
    assert worst_uncalibrated > 0.2  # the planted factors matter...
    assert worst <= 0.05  # ...and calibration recovers them


def test_calibration_without_data_keeps_priors_and_rejects_bad_input():
    job = ppo_job(8)
    hw = Hardware(job.cluster)
    cal = Calibrator(hw)
    assert cal.fit() == {}
    plan = random_plans(job, hw, 1, random.Random(1))[0]
    assert cal.predict(job, plan).step_time_s == pytest.approx(estimate_plan(hw, job, plan).step_time_s)
    with pytest.raises(SpecError, match=r"measured\.actor/training: must be a positive number"):
        cal.observe(job, plan, {"actor/training": -1.0})
    with pytest.raises(SpecError, match=r"measured\.judge/inference: not a model-stage"):
        cal.observe(job, plan, {"judge/inference": 1.0})


def test_a_lever_on_rollout_time_is_calibrated_at_its_plain_equivalent():
    from nereus.spec.levers import GenerationLevers, Speculation

    measured = {"actor/generation": 30.0, "actor/training": 12.0}
    spec = Speculation("suffix", 4, 64)
    levers = GenerationLevers(speculation=spec, predicted={"base_s": 90.0, "generation_s": 45.0})
    assert plain_equivalent(measured, levers) == {"actor/generation": 60.0, "actor/training": 12.0}
    assert plain_equivalent(measured, None) == measured
    whole_steps = GenerationLevers(speculation=spec, predicted={"base_s": 90.0, "step_s": 70.0})
    assert plain_equivalent(measured, whole_steps) == measured  # no generation-only prediction: as measured


def test_known_factors_replace_the_fit_for_every_term_the_rows_exercise():
    """One layout measured: the fit shares one factor per stage kind (``min_layouts``), the known factors
    are taken term by term instead (a term they lack keeps its prior 1), and the residual is computed on
    them, so a run handed the truth reports its noise alone."""
    rng = random.Random(3)
    job = ppo_job(8)
    hw = Hardware(job.cluster)
    plan = random_plans(job, hw, 1, rng)[0]
    planted = {f"{stage}.{term}": rng.uniform(0.5, 2.0)
               for stage in ("generation", "inference", "training") for term in TERMS}
    del planted["training.optimizer"]  # unknown: it keeps the prior, in the truth as in the known factors
    truth = estimate_plan(hw, job, plan, planted)
    fitted, known = Calibrator(hw), Calibrator(hw, known=planted)
    for cal in (fitted, known):
        for _ in range(4):
            cal.observe(job, plan, dict(truth.stage_times))
        cal.fit()
    generation = {k: v for k, v in fitted.factors.items() if k.startswith("generation.")}
    assert len(set(generation.values())) == 1  # one layout: the terms share one fitted factor
    exercised = set(fitted.factors)
    assert set(known.factors) == exercised and all(known.factors[k] == planted[k] for k in exercised if k in planted)
    assert exercised - set(planted) == {"training.optimizer"} and known.factors["training.optimizer"] == 1.0
    assert known.predict(job, plan).step_time_s == pytest.approx(truth.step_time_s)
    assert max(abs(e) for e in known.relative_errors()) < 1e-9
