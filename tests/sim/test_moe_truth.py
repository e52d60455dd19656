"""The simulator's truth prices an MoE job through the cost model, with a hidden factor of its own on the
experts' all-to-all (``sim.backend.hidden_factors``); a dense job's factors are unchanged by it."""

import pytest

from nereus.cost.hardware import Hardware
from nereus.cost.stages import stage_cost
from nereus.sim.backend import TruthConfig, hidden_factors
from nereus.spec.job import load_job
from nereus.spec.layout import Layout, ModelStage
from nereus.spec.model import PRESETS
from tests.conftest import EXAMPLES


def test_ep_comm_has_its_own_hidden_factor_drawn_last():
    factors = hidden_factors(3, TruthConfig())
    assert {"generation.ep_comm", "inference.ep_comm", "training.ep_comm"} <= set(factors)
    assert list(factors)[-3:] == ["generation.ep_comm", "inference.ep_comm", "training.ep_comm"]


def test_an_ep_training_layout_pays_the_all_to_all_and_the_truth_scales_it():
    job = load_job(EXAMPLES / "qwen3_30b_a3b_grpo.yaml")
    assert job.models["actor"] == PRESETS["qwen3-30b-a3b"]
    cost = stage_cost(Hardware(job.cluster), job, ModelStage("actor", "training"), Layout(dp=64, ep=8))
    assert cost is not None and cost.terms["ep_comm"] > 0
    doubled = cost.time({"training.ep_comm": 2.0})
    assert doubled - cost.time() == pytest.approx(cost.terms["ep_comm"], rel=1e-12)  # float sums: not bit-equal
