"""verl's on-policy check of the rollout engine (``run.report.rollout_probs_diff``)."""

from __future__ import annotations

import math

import torch

from nereus.run.report import rollout_probs_diff


def test_identical_log_probs_give_zero_difference_and_full_correlation():
    lp = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.1, 0.6, 0.3]]))
    m = rollout_probs_diff(lp, lp.clone(), torch.ones(2, 3))
    assert m["training/rollout_probs_diff_valid"] == 1.0
    assert m["training/rollout_probs_diff_max"] == 0.0 and m["training/rollout_probs_diff_mean"] == 0.0
    assert math.isclose(m["training/rollout_actor_probs_pearson_corr"], 1.0, rel_tol=1e-9)


def test_difference_is_of_probabilities_over_response_tokens_only():
    rollout = torch.log(torch.tensor([[0.5, 0.4, 0.9]]))
    actor = torch.log(torch.tensor([[0.4, 0.4, 0.1]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third token is padding: its 0.8 gap is not counted
    m = rollout_probs_diff(rollout, actor, mask)
    assert math.isclose(m["training/rollout_probs_diff_max"], 0.1, rel_tol=1e-6)
    assert math.isclose(m["training/rollout_probs_diff_mean"], 0.05, rel_tol=1e-6)
    assert math.isclose(m["training/rollout_probs_diff_std"], torch.tensor([0.1, 0.0]).std().item(), rel_tol=1e-5)


def test_too_few_tokens_is_marked_invalid():
    assert rollout_probs_diff(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([[1.0, 0.0]])) == {
        "training/rollout_probs_diff_valid": 0.0}
