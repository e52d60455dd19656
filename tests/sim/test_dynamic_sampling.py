"""Dynamic sampling in the simulator (DAPO, arXiv:2503.14476; sim.dynamic_sampling): a step draws generation
batches until it keeps its groups, and its generation takes that many batches."""

import numpy as np
import pytest

from nereus.control.controller import Controller
from nereus.cost.hardware import Hardware
from nereus.planner.search import search
from nereus.sim.backend import SimBackend
from nereus.sim.dynamic_sampling import draw_batches
from nereus.spec import job_from_dict
from nereus.spec.trace import trace_from_dict


def _grpo(keep_rate: float = 1.0):
    return job_from_dict({
        "name": "grpo-small", "models": {m: {"preset": "qwen2.5-0.5b"} for m in ("actor", "reference")},
        "algorithm": {"name": "grpo", "models": ["actor", "reference"], "samples_per_prompt": 8, "mini_batches": 2},
        "workload": {"prompts_per_step": 32, "prompt_length": 256, "filter_keep_rate": keep_rate,
                     "response_length": {"mean": 512, "max": 4096}},
        "cluster": {"gpu": "H100", "nodes": 1, "gpus_per_node": 8}})


def _trace(steps=4):
    return trace_from_dict({"source": "test", "steps": steps,
                            "response_length": {"sigma": 1.0, "points": [{"step": 0, "mean": 800, "max": 8192}]}})


def test_batches_are_drawn_until_the_groups_are_kept():
    rng = np.random.default_rng(0)
    draws = [draw_batches(rng, 0.3, 32) for _ in range(400)]
    assert all(d.kept >= 32 and d.generated == 32 * d.batches for d in draws)
    assert np.mean([d.batches for d in draws]) == pytest.approx(1 / 0.3, abs=0.5)
    assert draw_batches(rng, 1.0, 32).batches == 1
    with pytest.raises(ValueError, match="keep_rate"):
        draw_batches(rng, 0.0, 32)


def test_the_simulators_step_generates_more_batches_with_filtering_on():
    plan = search(Hardware(_grpo().cluster), _grpo()).plan
    off = SimBackend(_grpo(), _trace()).run_step(plan, 1, Controller(_grpo()))
    on = SimBackend(_grpo(0.3), _trace()).run_step(plan, 1, Controller(_grpo(0.3)))
    assert "train/num_gen_batches" not in off.detail
    batches = on.detail["train/num_gen_batches"]
    assert batches >= 2 and 0 < on.detail["train/filter_groups_keep_rate"] < 1
    # the same lengths and noise at the same (seed, step): generation scales by the drawn batches
    assert on.phase_times_s["generation"] == pytest.approx(batches * off.phase_times_s["generation"])
    assert on.stage_times_s["actor/training"] == pytest.approx(off.stage_times_s["actor/training"])
