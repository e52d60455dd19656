"""A published layout with an uneven pipeline split (Megatron's remainder on the first/last stages) is priced
at its fullest stage; a user's own plan with one is refused as run refuses it (``check_runnable``)."""

from __future__ import annotations

import pytest

from nereus.cost.hardware import Hardware
from nereus.cost.plan_cost import check_runnable, estimate_plan
from nereus.cost.published import gpt_training_job
from nereus.spec.errors import SpecError
from nereus.spec.layout import Layout, ModelStage, Placement, Plan


def _plan(pp: int) -> Plan:
    layout = Layout(tp=1, pp=pp, dp=1, micro_batch_size=1, recompute="full")
    return Plan((Placement(ModelStage("gpt", "training"), layout, tuple(range(pp))),), 8)


def test_an_uneven_split_costs_what_its_fullest_stage_costs():
    # 25 layers at PP4: Megatron's best split is 7 + 6 + 6 + 6 (the end stages take the remainder), so its
    # fullest stage paces it like 28 layers at PP4
    uneven, even = gpt_training_job(25, 1024, 16, 64, 8), gpt_training_job(28, 1024, 16, 64, 8)
    hw = Hardware(uneven.cluster)
    t_uneven = estimate_plan(hw, uneven, _plan(4)).stage_times["gpt/training"]
    t_even = estimate_plan(hw, even, _plan(4)).stage_times["gpt/training"]
    t_shorter = estimate_plan(hw, gpt_training_job(24, 1024, 16, 64, 8), _plan(4)).stage_times["gpt/training"]
    assert t_shorter < t_uneven
    assert t_uneven == pytest.approx(t_even, rel=0.02)  # the same fullest stage; only the head/embedding differ


def test_a_users_plan_with_an_uneven_split_is_refused_as_run_refuses_it():
    job = gpt_training_job(25, 1024, 16, 64, 8)
    with pytest.raises(SpecError, match="pp=4 does not split the 25 layers evenly"):
        check_runnable(job, _plan(4))
    check_runnable(gpt_training_job(24, 1024, 16, 64, 8), _plan(4))
