"""``run.policy_loss`` (nereus.spec.run_algorithm): the loss's name and options under verl's names, verl's
defaults, and one-line refusals naming the key before anything runs."""

from __future__ import annotations

import pytest

from nereus.spec.algorithms import POLICY_LOSSES
from nereus.spec.errors import SpecError
from nereus.spec.job import job_from_dict
from nereus.spec.run_algorithm import PolicyLossSpec


def _spec(policy_loss: dict | None = None, **run: object) -> dict:
    return {"models": {m: {"preset": "qwen2.5-0.5b"} for m in ("actor", "reference")},
            "algorithm": {"name": "grpo"},
            "workload": {"prompts_per_step": 4, "prompt_length": 8, "response_length": {"mean": 3, "max": 4}},
            "cluster": {"gpu": "H100", "nodes": 1, "gpus_per_node": 4},
            "run": {**run, **({"policy_loss": policy_loss} if policy_loss is not None else {})}}


def test_defaults_are_verls():
    p = job_from_dict(_spec()).run.policy_loss
    assert p == PolicyLossSpec()
    assert (p.loss_mode, p.tau_pos, p.tau_neg, p.clip_cov_ratio, p.clip_cov_lb, p.clip_cov_ub, p.kl_cov_ratio,
            p.ppo_kl_coef, p.dro_beta) == ("vanilla", 1.0, 1.05, 0.0002, 1.0, 5.0, 0.0002, 0.1, None)


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_every_registered_loss_is_accepted(name):
    extra = {"dro_beta": 0.1} if name == "dro" else {}
    assert job_from_dict(_spec({"loss_mode": name, **extra})).run.policy_loss.loss_mode == name


def test_options_reach_the_loss_under_verls_names():
    p = job_from_dict(_spec({"loss_mode": "bypass_mode", "tau_pos": 2.0, "kl_cov_ratio": 0.01,
                             "rollout_correction": {"loss_type": "reinforce", "rollout_is": "sequence",
                                                    "rollout_is_threshold": "0.5_2.0", "rollout_rs": "token_k1",
                                                    "rollout_rs_threshold": 3}})).run.policy_loss
    o = p.options()
    assert "loss_mode" not in o and (o["tau_pos"], o["kl_cov_ratio"]) == (2.0, 0.01)
    assert (o["loss_type"], o["rollout_is"], o["rollout_is_threshold"], o["rollout_rs"], o["rollout_rs_threshold"]) \
        == ("reinforce", "sequence", "0.5_2.0", "token_k1", 3.0)


@pytest.mark.parametrize(("policy_loss", "match"), [
    ({"loss_mode": "ppo2"}, r"^run\.policy_loss\.loss_mode: 'ppo2' is not allowed; choose one of \['vanilla', 'gspo', "
                            r"'sapo', 'gpg', 'clip_cov', 'kl_cov', 'geo_mean', 'cispo', 'dppo_tv', 'dppo_kl', 'dro', "
                            r"'bypass_mode'\]"),
    ({"loss_mode": "dro"}, r"run\.policy_loss\.dro_beta: dro needs"),
    ({"loss_mode": "clip_cov", "clip_cov_ratio": 0}, r"run\.policy_loss\.clip_cov_ratio: clip_cov selects"),
    ({"loss_mode": "sapo", "tau_neg": 0}, r"run\.policy_loss\.tau_neg: SAPO's gate"),
    ({"clip_cov_ration": 0.1}, r"run\.policy_loss\.clip_cov_ration: unknown key; did you mean 'clip_cov_ratio'"),
    ({"rollout_correction": {"rollout_rs": "token_k9"}}, r"rollout_correction\.rollout_rs: 'token_k9' is not"),
    ({"rollout_correction": {"rollout_rs": "seq_mean_k3"}}, r"rollout_correction\.rollout_rs_threshold: rollout_rs "
                                                            r"needs"),
])
def test_bad_values_are_refused_naming_the_key(policy_loss, match):
    with pytest.raises(SpecError, match=match):
        job_from_dict(_spec(policy_loss))


def test_token_sum_is_an_aggregation_mode():
    assert job_from_dict(_spec(loss_agg_mode="token-sum")).run.loss_agg_mode == "token-sum"
