"""Response lengths (``spec.response``): a mean is that of the lengths as generated, clipped at the cap, in
the cost model's quantiles and in the simulator's draws alike."""

from __future__ import annotations

import math

import numpy as np
import pytest

from nereus.cost.tail.lengths import GroupLengths
from nereus.sim.groups import draw_groups
from nereus.spec.response import ResponseLength, lognormal_mu


@pytest.mark.parametrize(("mean", "cap", "sigma"), [(3083, 4096, 1.0), (5578, 8192, 1.0), (3000, 20480, 1.0),
                                                    (1500, 8192, 0.7), (700, 1536, 0.6)])
def test_the_clipped_log_normal_averages_the_stated_mean(mean: float, cap: int, sigma: float) -> None:
    mu = lognormal_mu(mean, sigma, cap)
    draws = np.minimum(np.random.default_rng(0).lognormal(mu, sigma, 2_000_000), cap)
    assert draws.mean() == pytest.approx(mean, rel=2e-3)
    assert np.mean(ResponseLength(mean, cap, "lognormal", sigma).quantiles(4096)) == pytest.approx(mean, rel=2e-3)
    # the unclipped law's location, ln(mean) - sigma^2/2, would generate fewer tokens than published
    unclipped = np.minimum(np.random.default_rng(0).lognormal(math.log(mean) - sigma**2 / 2, sigma, 200_000), cap)
    assert unclipped.mean() < mean * (1 - 1e-3)
    assert mu > math.log(mean) - sigma**2 / 2


def test_a_cap_far_above_the_mean_leaves_the_law_as_it_was_and_a_mean_at_the_cap_puts_lengths_there() -> None:
    assert lognormal_mu(1000, 0.6, 10**9) == pytest.approx(math.log(1000) - 0.18, abs=1e-9)
    assert lognormal_mu(1000, 0.0, 4096) == pytest.approx(math.log(1000))
    assert ResponseLength(4096, 4096, "lognormal", 1.0).quantiles(8)[0] == pytest.approx(4096, rel=1e-3)


def test_the_cost_models_groups_and_the_simulators_draws_share_the_location() -> None:
    resp = ResponseLength(3083, 4096, "lognormal", 1.0)
    assert GroupLengths.of(resp, 0.5, 16).mu == resp.mu
    rng = np.random.default_rng(1)
    drawn = draw_groups(rng, resp, rng.standard_normal(50_000), 16, 0.5)
    assert drawn.mean() == pytest.approx(3083, rel=5e-3) and drawn.max() <= 4096
