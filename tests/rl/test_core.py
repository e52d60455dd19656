"""The RL math against values computed by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from nereus.rl.core import (
    ADVANTAGE_ESTIMATOR_FNS,
    KL_ESTIMATORS,
    AdvantageInputs,
    advantage_estimator,
    clipped_policy_loss,
    clipped_value_loss,
    entropy_from_logits,
    gae,
    grpo_advantages,
    kl_estimate,
    masked_mean,
    masked_whiten,
    token_rewards,
)
from nereus.spec import SpecError, job_from_dict
from nereus.spec.algorithms import ADVANTAGE_ESTIMATORS, KL_ALIASES, KL_ESTIMATOR_NAMES, KL_KINDS

T = torch.tensor


def close(a: torch.Tensor, b: list, tol: float = 1e-5) -> None:
    torch.testing.assert_close(a.float(), T(b, dtype=torch.float32), atol=tol, rtol=0)


def test_masked_mean_ignores_padding():
    x, m = T([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]]), T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert float(masked_mean(x, m)) == pytest.approx(2.0)  # (1+2+3)/3
    close(masked_mean(x, m, dim=1), [1.5, 3.0])
    assert float(masked_mean(x, torch.zeros_like(m))) == 0.0


def test_masked_whiten():
    # mean 2, unbiased variance ((1)+(0)+(1))/2 = 1 -> (x - 2) / 1; the padded 100 is ignored and zeroed
    close(masked_whiten(T([[1.0, 2.0, 3.0, 100.0]]), T([[1.0, 1.0, 1.0, 0.0]])), [[-1.0, 0.0, 1.0, 0.0]])


def test_gae_undiscounted_is_reward_to_go_minus_value():
    # gamma = lambda = 1: A_t = sum_{l>=t} r_l - V_t = 1 - V_t; returns are 1 everywhere
    adv, ret = gae(T([[0.0, 0.0, 1.0]]), T([[0.5, 0.6, 0.7]]), torch.ones(1, 3), 1.0, 1.0)
    close(adv, [[0.5, 0.4, 0.3]])
    close(ret, [[1.0, 1.0, 1.0]])


def test_gae_discounted_with_padding():
    # mask [1,1,0], gamma .9, lambda .5: V after the last real token is 0, so
    # t=1: delta = 3 + .9*0 - 2 = 1, A_1 = 1;  t=0: delta = 1 + .9*2 - 1 = 1.8, A_0 = 1.8 + .45*1 = 2.25
    adv, ret = gae(T([[1.0, 3.0, 9.0]]), T([[1.0, 2.0, 3.0]]), T([[1.0, 1.0, 0.0]]), 0.9, 0.5)
    close(adv, [[2.25, 1.0, 0.0]])
    close(ret, [[3.25, 3.0, 0.0]])


def test_grpo_group_normalised():
    # group 0: scores 1,0,0,1: mean .5, unbiased std sqrt(1/3) -> +-0.5*sqrt(3) = +-0.866025
    # group 1: equal scores -> 0; group 2: a single response -> verl's group of one: 7 / (1 + 1e-6)
    scores, groups = T([1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 7.0]), T([0, 0, 0, 0, 1, 1, 2])
    mask = torch.ones(7, 2)
    mask[0, 1] = 0
    adv = grpo_advantages(scores, groups, mask)
    h = 0.5 * math.sqrt(3)
    close(adv[:, 0], [h, -h, -h, h, 0.0, 0.0, 7.0 / (1 + 1e-6)])
    assert float(adv[0, 1]) == 0.0  # padding
    close(grpo_advantages(scores, groups, mask, std_normalise=False)[:4, 0], [0.5, -0.5, -0.5, 0.5])


def test_kl_estimators():
    # pi = .5, pi_ref = .25: log r = ln 2; k2 = ln(2)^2 / 2; k3 = 1/r - 1 + log r = .5 - 1 + ln 2
    logp, ref = T([math.log(0.5)]), T([math.log(0.25)])
    assert float(kl_estimate(logp, ref, "k1")) == pytest.approx(math.log(2), abs=1e-6)
    assert float(kl_estimate(logp, ref, "k2")) == pytest.approx(0.5 * math.log(2) ** 2, abs=1e-6)
    assert float(kl_estimate(logp, ref, "k3")) == pytest.approx(math.log(2) - 0.5, abs=1e-6)
    assert float(kl_estimate(ref, ref, "k3")) == 0.0
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logp, ref, "k4")


def test_token_rewards_score_on_last_token_minus_kl():
    mask = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    r = token_rewards(T([1.0, 2.0]), mask, kl=torch.full((2, 3), 0.1), kl_coef=0.5)
    close(r, [[-0.05, 0.95, 0.0], [-0.05, -0.05, 1.95]])


@pytest.mark.parametrize(("ratio", "adv", "loss", "clipped"), [
    (1.5, 1.0, -1.2, 1.0),   # -A*r = -1.5, -A*clip = -1.2: the clipped term is larger
    (1.5, -1.0, 1.5, 0.0),   # 1.5 vs 1.2
    (0.5, 1.0, -0.5, 0.0),   # -0.5 vs -0.8
    (0.5, -1.0, 0.8, 1.0),   # 0.5 vs 0.8
])
def test_clipped_policy_loss(ratio, adv, loss, clipped):
    out, frac, _ = clipped_policy_loss(T([math.log(ratio)]), T([0.0]), T([adv]), 0.2)
    assert float(out) == pytest.approx(loss, abs=1e-6)
    assert float(frac) == clipped


def test_clip_higher():
    # r = 1.5 with A = 1: clip at 1 + 0.28 -> -1.28
    out, _, _ = clipped_policy_loss(T([math.log(1.5)]), T([0.0]), T([1.0]), 0.2, 0.28)
    assert float(out) == pytest.approx(-1.28, abs=1e-6)


def test_clipped_value_loss():
    # V_old 1, V 2, R 3, c .5: (2-3)^2 = 1, clipped V = 1.5 -> 2.25: loss .5 * 2.25
    # V 1.2 is inside the clip range: both terms 3.24, loss 1.62, not clipped
    loss, frac = clipped_value_loss(T([2.0, 1.2]), T([1.0, 1.0]), T([3.0, 3.0]), 0.5)
    close(loss, [1.125, 1.62])
    close(frac, [1.0, 0.0])


def test_entropy():
    # uniform over 4: ln 4; probabilities (.25, .75): -(.25 ln .25 + .75 ln .75)
    h = entropy_from_logits(T([[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e9, -1e9]]))
    close(h, [math.log(4), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))])


def _rl_spec(name: str, algorithm: dict | None = None, run: dict | None = None) -> dict:
    models = ("actor", "critic", "reference") if name == "ppo" else ("actor", "reference")
    return {"models": {m: {"preset": "qwen2.5-0.5b"} for m in models},
            "algorithm": {"name": name, **(algorithm or {})},
            "workload": {"prompts_per_step": 4, "prompt_length": 8, "response_length": {"mean": 3, "max": 4}},
            "cluster": {"gpu": "H100", "nodes": 1, "gpus_per_node": 4}, "run": run or {}}


def test_registries_hold_exactly_the_names_the_spec_accepts():
    assert tuple(KL_ESTIMATORS) == KL_ESTIMATOR_NAMES
    assert set(KL_ALIASES.values()) == set(KL_ESTIMATOR_NAMES)
    assert tuple(ADVANTAGE_ESTIMATOR_FNS) == ADVANTAGE_ESTIMATORS
    assert job_from_dict(_rl_spec("ppo")).algorithm.adv_estimator == "gae"
    assert job_from_dict(_rl_spec("grpo")).algorithm.adv_estimator == "grpo"


@pytest.mark.parametrize("kind", KL_KINDS)
def test_each_kl_kind_is_accepted_by_the_spec_and_computes(kind):
    run = job_from_dict(_rl_spec("ppo", run={"kl_penalty": kind, "kl_loss_type": kind})).run
    assert run.kl_penalty == kind and run.kl_loss_type == kind
    logp, ref = T([[math.log(0.5), math.log(0.2)]]), T([[math.log(0.25), math.log(0.2)]])
    kl = kl_estimate(logp, ref, kind)
    assert kl.shape == (1, 2) and float(kl[0, 0]) > 0 and float(kl[0, 1]) == 0.0  # zero where π = π_ref


def _inputs(**kw) -> AdvantageInputs:
    # two prompts with two responses each; response 1 is one token long
    mask = T([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    base = {"scores": T([1.0, 0.0, 2.0, 0.0]), "mask": mask, "groups": T([0, 0, 1, 1]),
            "old_logp": torch.full((4, 2), -1.0), "values": T([[0.5, 0.2], [0.1, 0.0], [0.3, 0.3], [0.0, 0.4]]),
            "gamma": 1.0, "lam": 1.0}
    return AdvantageInputs(**{**base, **kw})


@pytest.mark.parametrize("name", ["gae", "grpo"])  # every other estimator: tests/rl/test_advantages.py
def test_gae_and_grpo_are_accepted_by_the_spec_and_compute(name):
    spec_name = "grpo" if name == "grpo" else "ppo"
    assert job_from_dict(_rl_spec(spec_name, {"adv_estimator": name})).algorithm.adv_estimator == name
    x = _inputs()
    out = advantage_estimator(name)(x)
    assert out["adv"].shape == (4, 2) and float(out["adv"][1, 1]) == 0.0  # padding stays 0
    if name == "grpo":  # ±score spread within each group: (1, 0) -> ±1/√2·√2 = ±0.7071
        close(out["adv"][:, 0], [0.707107, -0.707107, 0.707107, -0.707107])
    else:  # reward-to-go minus value, then whitened: same as composing the pieces by hand
        rewards = token_rewards(x.scores, x.mask)
        adv, ret = gae(rewards, x.values, x.mask, 1.0, 1.0)
        torch.testing.assert_close(out["adv"], masked_whiten(adv, x.mask))
        torch.testing.assert_close(out["returns"], ret)


def test_gae_estimator_applies_the_kl_penalty_only_with_reference_logprobs():
    ref = torch.full((4, 2), -2.0)  # log r = 1 on every token
    plain = advantage_estimator("gae")(_inputs(kl_coef=0.1))
    penalised = advantage_estimator("gae")(_inputs(kl_coef=0.1, ref_logp=ref, kl_penalty="k1"))
    torch.testing.assert_close(penalised["rewards"], plain["rewards"] - 0.1 * _inputs().mask)
    with pytest.raises(ValueError, match="needs critic values"):
        advantage_estimator("gae")(_inputs(values=None))


def test_unknown_names_are_rejected_with_the_choices():
    with pytest.raises(ValueError, match=r"'vtrace'.*\['gae', 'grpo', 'reinforce_plus_plus', "):
        advantage_estimator("vtrace")
    with pytest.raises(SpecError, match=r"algorithm\.adv_estimator"):
        job_from_dict(_rl_spec("ppo", {"adv_estimator": "vtrace"}))
    with pytest.raises(SpecError, match=r"algorithm\.adv_estimator: gae needs a 'critic'"):
        job_from_dict(_rl_spec("grpo", {"adv_estimator": "gae"}))
