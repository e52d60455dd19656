"""The in-reward KL coefficient's controller (``rl.kl_control``): Ziegler et al.'s adaptive update against
a plain reference, the fixed one, rewinding a redone step, and its checkpointed state."""

from __future__ import annotations

import pytest
import torch

from nereus.rl.kl_control import KLController, adaptive_kl_coef, reward_kl


def _ziegler(beta: float, kl: float, n: int, target: float, horizon: int) -> float:
    error = max(-0.2, min(0.2, kl / target - 1))
    return beta * (1 + error * n / horizon)


@pytest.mark.parametrize("kl", [0.0, 0.05, 0.1, 0.11, 0.5, 3.0])
def test_adaptive_update_is_ziegler_et_al(kl):
    assert adaptive_kl_coef(0.02, kl, 64, 0.1, 1000) == pytest.approx(_ziegler(0.02, kl, 64, 0.1, 1000), rel=1e-12)


def test_controller_moves_toward_the_target_and_fixed_stays():
    ctrl, beta = KLController(0.01, "adaptive", target_kl=0.1, horizon=100), 0.01
    for step, kl in enumerate([0.5, 0.4, 0.02, 0.1]):
        assert ctrl.begin(step) == pytest.approx(beta)
        ctrl.update(kl, 16)
        beta = _ziegler(beta, kl, 16, 0.1, 100)
    assert ctrl.value == pytest.approx(beta)
    assert KLController(0.01, "adaptive", 0.1, 100).begin(0) == 0.01
    up = KLController(0.01, "adaptive", 0.1, 100)
    up.update(1.0, 16)  # above target: the coefficient grows, by at most 20% of n/horizon
    assert up.value == pytest.approx(0.01 * (1 + 0.2 * 0.16))
    fixed = KLController(0.01)
    fixed.update(5.0, 16)
    assert fixed.value == 0.01


def test_a_redone_step_starts_from_the_coefficient_it_first_had():
    ctrl = KLController(0.01, "adaptive", 0.1, 10)
    first = []
    for step in range(3):
        first.append(ctrl.begin(step))
        ctrl.update(0.5, 8)
    assert ctrl.begin(1) == first[1]  # a recovery redoes step 1: later updates are forgotten
    ctrl.update(0.5, 8)
    assert ctrl.begin(2) == pytest.approx(first[2])


def test_state_round_trips_through_a_checkpoint():
    ctrl = KLController(0.01, "adaptive", 0.1, 10)
    ctrl.begin(0)
    ctrl.update(0.5, 8)
    again = KLController(0.01, "adaptive", 0.1, 10)
    again.load_state_dict(ctrl.state_dict())
    assert again.begin(1) == ctrl.value != 0.01


def test_reward_kl_is_verls_token_mean_then_batch_mean():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.1, -4.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -0.6, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    per_row = [(0.5 + -1.0) / 2, (-0.1 + 0.5 + -3.0) / 3]  # k1: logp − ref_logp, token mean per response
    assert reward_kl(logp, ref, mask, "k1") == pytest.approx(sum(per_row) / 2)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="unknown KL controller"):
        KLController(0.01, "pid")
    with pytest.raises(ValueError, match="target_kl > 0"):
        KLController(0.01, "adaptive", target_kl=0.0)
