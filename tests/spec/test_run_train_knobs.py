"""``run.kl_ctrl``, ``run.lr_scheduler_type`` / ``min_lr_ratio`` / ``num_cycles``, ``run.top_k`` and
``run.critic_warmup`` (``spec.run_train_knobs``): values, verl's cosine schedule against its formula, and
the refusals."""

from __future__ import annotations

import math

import pytest

from nereus.spec.errors import SpecError
from nereus.spec.job import job_from_dict
from nereus.spec.run_train_knobs import actor_updates_at


def _job(run: dict, algorithm: str = "ppo"):
    models = {"actor": {"preset": "llama3-8b"}, "critic": {"preset": "llama3-8b"}}
    if algorithm == "grpo":
        models = {"actor": {"preset": "llama3-8b"}}
    return job_from_dict({"models": models, "algorithm": {"name": algorithm},
                          "workload": {"prompts_per_step": 4, "prompt_length": 8,
                                       "response_length": {"mean": 3, "max": 4}},
                          "cluster": {"gpu": "H100", "nodes": 1, "gpus_per_node": 4}, "run": run})


def _cosine(step: int, warmup: int, total: int, m: float, cycles: float) -> float:
    """verl's get_cosine_schedule_with_warmup lambda (init_lr_ratio 0), written out."""
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return max(m, math.cos(math.pi * cycles * 2.0 * progress) * (1 - m) * 0.5 + (1 + m) * 0.5)


@pytest.mark.parametrize("warmup, m, cycles", [(0, 0.0, 0.5), (4, 0.0, 0.5), (5, 0.1, 0.5), (3, 0.2, 1.5)])
def test_cosine_schedule_is_verls(warmup, m, cycles):
    run = _job({"steps": 40, "lr_warmup_steps": warmup, "lr_scheduler_type": "cosine", "min_lr_ratio": m,
                "num_cycles": cycles}).run
    for step in (0, 1, 3, 4, 5, 10, 20, 33, 39, 40):
        assert run.lr_at(2e-4, step) == pytest.approx(2e-4 * _cosine(step, warmup, 40, m, cycles), rel=1e-12)
    assert run.lr_at(1.0, 40) == pytest.approx(max(m, _cosine(40, warmup, 40, m, cycles)))


def test_defaults_are_verls_and_constant_is_unchanged():
    run = _job({"steps": 10, "lr_warmup_steps": 2}).run
    assert run.lr_schedule.type == "constant" and run.top_k == -1 and run.critic_warmup == 0
    assert run.kl_ctrl.type == "fixed" and run.kl_ctrl.target_kl == 0.1 and run.kl_ctrl.horizon == 10000
    assert [run.lr_at(1.0, s) for s in range(4)] == [0.0, 0.5, 1.0, 1.0]


def test_critic_warmup_holds_the_actor_and_its_schedule():
    run = _job({"steps": 10, "critic_warmup": 3, "lr_warmup_steps": 2}).run
    # verl: the actor trains once critic_warmup <= its 1-based global step
    assert [actor_updates_at(run.critic_warmup, s) for s in range(4)] == [False, False, True, True]
    # the actor's schedule counts its own updates only; the critic's counts every step
    assert [run.lr_at(1.0, s, "actor") for s in (2, 3, 4)] == [0.0, 0.5, 1.0]
    assert [run.lr_at(1.0, s, "critic") for s in (0, 1, 2)] == [0.0, 0.5, 1.0]


def test_knobs_are_read():
    run = _job({"top_k": 20, "kl_coef": 0.01, "kl_ctrl": {"type": "adaptive", "target_kl": 0.05, "horizon": 100},
                "critic_warmup": 2}).run
    assert run.top_k == 20 and run.critic_warmup == 2
    assert (run.kl_ctrl.type, run.kl_ctrl.target_kl, run.kl_ctrl.horizon) == ("adaptive", 0.05, 100)


@pytest.mark.parametrize("run, key, words", [
    ({"kl_ctrl": {"type": "pid"}}, "run.kl_ctrl.type", "choose one of ['fixed', 'adaptive']"),
    ({"kl_ctrl": {"type": "adaptive", "target_kl": 0}}, "run.kl_ctrl.target_kl", "above 0"),
    ({"kl_ctrl": {"type": "adaptive", "horizon": 0}}, "run.kl_ctrl.horizon", "at least 1"),
    ({"kl_ctrl": {"typo": 1}}, "run.kl_ctrl.typo", "unknown key"),
    ({"lr_scheduler_type": "linear"}, "run.lr_scheduler_type", "choose one of ['constant', 'cosine']"),
    ({"min_lr_ratio": 1.5}, "run.min_lr_ratio", "<= 1"),
    ({"min_lr_ratio": -0.1}, "run.min_lr_ratio", ">= 0"),
    ({"top_k": -2}, "run.top_k", ">= -1"),
    ({"critic_warmup": -1}, "run.critic_warmup", ">= 0"),
])
def test_bad_knobs_are_refused_by_key(run, key, words):
    with pytest.raises(SpecError) as err:
        _job(run)
    assert err.value.path == key and words in str(err.value)


def test_critic_warmup_needs_a_critic():
    assert _job({"critic_warmup": 0}, "grpo").run.critic_warmup == 0
    with pytest.raises(SpecError) as err:
        _job({"critic_warmup": 2}, "grpo")
    assert err.value.path == "run.critic_warmup" and "add a critic" in str(err.value)
    assert "\n" not in str(err.value)
