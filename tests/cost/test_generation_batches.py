"""Dynamic sampling (DAPO, arXiv:2503.14476) priced: a step that keeps keep-rate × P groups per generation
batch generates 1 / keep-rate batches' responses (cost.stages.generation_batches)."""

import pytest

from nereus.cost.hardware import Hardware
from nereus.cost.plan_cost import estimate_plan
from nereus.planner.search import search
from tests.sim.test_dynamic_sampling import _grpo


def test_priced_generation_grows_as_the_keep_rate_falls():
    job = _grpo()
    plan = search(Hardware(job.cluster), job).plan
    hw = Hardware(job.cluster)
    gen = {k: estimate_plan(hw, _grpo(k), plan).stage_times["actor/generation"] for k in (1.0, 0.5, 0.25)}
    assert gen[1.0] < gen[0.5] < gen[0.25]
    assert gen[0.25] == pytest.approx(4 * gen[1.0])  # 1 / keep-rate batches' responses
    rest = {k: estimate_plan(hw, _grpo(k), plan).stage_times["actor/training"] for k in (1.0, 0.25)}
    assert rest[1.0] == rest[0.25]  # the step still trains prompts_per_step groups
