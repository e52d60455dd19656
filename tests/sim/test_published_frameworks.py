"""A framework's measured training throughput (``published_frameworks.TRAINING_EFFICIENCY``): OpenRLHF's and
DeepSpeed-Chat's rows price their training stages' GEMMs at it, the same for every row of the framework;
verl's rows keep the cost model's prior, and no other stage changes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from nereus.cost.hardware import Hardware, Priors
from nereus.cost.stages import stage_cost
from nereus.sim.published_frameworks import TRAINING_EFFICIENCY
from nereus.sim.published_runs import published_run
from tests.helpers import published_rows as rows


@pytest.mark.parametrize("run_id", ["openrlhf_7B", "openrlhf_70B", "dschat_7B", "dschat_70B"])
def test_openrlhf_and_deepspeed_chat_rows_take_their_frameworks_measured_training_efficiency(run_id: str) -> None:
    row = rows()[run_id]
    assert published_run(row).job.options.training_efficiency == TRAINING_EFFICIENCY[row["framework"]]


def test_measured_efficiencies_are_fractions_below_the_prior() -> None:
    assert all(0 < e < Priors().gemm_efficiency for e in TRAINING_EFFICIENCY.values())


def test_verl_rows_keep_the_prior() -> None:
    verl = [r for r in rows().values() if r["framework"] == "verl" and r["run_id"].startswith("verl_oso")]
    assert verl and all(published_run(r).job.options.training_efficiency == 0.0 for r in verl)


def test_only_the_training_stages_compute_is_priced_at_it() -> None:
    run = published_run(rows()["dschat_7B"])
    hw = Hardware(run.job.cluster)
    prior = replace(run.job, options=replace(run.job.options, training_efficiency=0.0))
    for placement in run.plan.placements:
        ms, layout = placement.model_stage, placement.layout
        measured, default = stage_cost(hw, run.job, ms, layout), stage_cost(hw, prior, ms, layout)
        if ms.stage == "training":
            ratio = Priors().gemm_efficiency / TRAINING_EFFICIENCY["DeepSpeed-Chat"]
            assert measured.terms["compute"] == pytest.approx(default.terms["compute"] * ratio)
            assert measured.terms["dp_comm"] == pytest.approx(default.terms["dp_comm"])
        else:
            assert measured.terms == default.terms
