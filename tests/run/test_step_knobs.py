"""The RL step's per-run knobs (``run.step_knobs``): the in-reward KL coefficient adapted step to step with
verl's metric names, and the critic-only warm-up steps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nereus.rl.kl_control import adaptive_kl_coef
from nereus.run.step_knobs import RewardKL, warmup_jobs
from nereus.spec.errors import SpecError
from tests.run.jobs import tiny_job


def _step(kl_per_token: float) -> tuple[SimpleNamespace, SimpleNamespace]:
    mask = torch.ones(4, 3)
    old = torch.full((4, 3), -1.0)
    return SimpleNamespace(mask=mask), SimpleNamespace(old_logp=old, ref_logp=old - kl_per_token)


def test_reward_kl_adapts_and_reports_the_coefficient_it_used(tmp_path):
    job = tiny_job("ppo", str(tmp_path), kl_coef=0.01,
                   kl_ctrl={"type": "adaptive", "target_kl": 0.1, "horizon": 40})
    knob = RewardKL(job)
    beta = knob.begin(0)
    roll, inf = _step(0.3)
    m = knob.end(roll, inf, beta)
    assert m == {"actor/reward_kl_penalty": pytest.approx(0.3), "actor/reward_kl_penalty_coeff": 0.01}
    assert knob.begin(1) == pytest.approx(adaptive_kl_coef(0.01, 0.3, 4, 0.1, 40))
    assert knob.begin(1) > 0.01  # the KL is above its target: the coefficient grows
    again = RewardKL(job)
    again.load_state_dict(knob.state_dict())
    assert again.begin(1) == knob.begin(1)
    with pytest.raises(SpecError, match="kl_ctrl"):
        again.load_state_dict({"kl_coef": "x"})


def test_no_kl_metrics_when_the_kl_is_a_loss(tmp_path):
    job = tiny_job("ppo", str(tmp_path), kl_coef=0.01, use_kl_loss=True)
    knob = RewardKL(job)
    assert knob.end(*_step(0.3), knob.begin(0)) == {}


def test_critic_warmup_drops_the_actors_update(tmp_path):
    job = tiny_job("ppo", str(tmp_path), critic_warmup=2)
    jobs = {"critic": "c", "actor": "a"}
    assert warmup_jobs(job, 0, jobs) == {"critic": "c"}
    assert warmup_jobs(job, 1, jobs) == jobs
