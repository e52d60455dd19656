"""Response lengths of one RL step: the distribution the cost model and the traces share."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist

# bisection steps for ``lognormal_mu``: a bracket of width 16 sigma narrowed to within 1e-9 sigma
MU_STEPS = 64


@lru_cache(maxsize=4096)
def lognormal_mu(mean: float, sigma: float, cap: float) -> float:
    """The location mu of the log-normal whose lengths, clipped at ``cap``, average ``mean``: a mean length
    is that of responses as generated, none past the cap (every published mean is). The clipped mean
    E[min(X, c)] = e^(mu + sigma^2/2) Phi((ln c - mu - sigma^2)/sigma) + c (1 - Phi((ln c - mu)/sigma)) (the
    log-normal's partial expectation) grows with mu from the unclipped mean's mu, ln(mean) - sigma^2/2, where
    it is below ``mean``; bisection finds it. A mean at the cap puts (nearly) every length there."""
    if sigma == 0:
        return math.log(mean)
    if mean >= cap:
        return math.log(cap) + 8 * sigma
    unclipped, normal, log_cap = math.log(mean) - sigma**2 / 2, NormalDist(), math.log(cap)

    def clipped_mean(mu: float) -> float:
        return (math.exp(mu + sigma**2 / 2) * normal.cdf((log_cap - mu - sigma**2) / sigma)
                + cap * (1 - normal.cdf((log_cap - mu) / sigma)))

    lo, hi = unclipped, max(unclipped, log_cap) + 8 * sigma
    for _ in range(MU_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if clipped_mean(mid) < mean else (lo, mid)
    return (lo + hi) / 2


@lru_cache(maxsize=256)
def _lognormal_quantiles(mean: float, longest: int, sigma: float, points: int) -> tuple[float, ...]:
    if sigma == 0:
        return (float(min(mean, longest)),) * points
    mu = lognormal_mu(mean, sigma, longest)
    normal = NormalDist()
    return tuple(min(float(longest), math.exp(mu + sigma * normal.inv_cdf((i + 0.5) / points)))
                 for i in range(points))


@dataclass(frozen=True)
class ResponseLength:
    """Response lengths of one step: log-normal, clipped at ``max``, with the given mean after clipping
    (``lognormal_mu``).

    Published runs show a long right tail that sets the generation time (docs/sources/rl_length_dynamics.md:
    Seer, TLT); a log-normal with sigma ≈ 0.6–1 reproduces "the last 10% take up to half the time".
    """

    mean: float
    max: int
    distribution: str = "lognormal"
    sigma: float = 0.6

    @property
    def mu(self) -> float:
        """The log-normal's location (``lognormal_mu``)."""
        return lognormal_mu(self.mean, self.sigma, self.max)

    def quantiles(self, points: int = 64) -> tuple[float, ...]:
        """``points`` equally weighted lengths (mid-quantiles), clipped at ``max``."""
        return _lognormal_quantiles(self.mean, self.max, self.sigma if self.distribution != "fixed" else 0.0,
                                    points)

    def longest(self, count: int) -> float:
        """Expected longest of ``count`` responses: the 1 − 1/(count+1) quantile, clipped at ``max``."""
        if self.distribution == "fixed" or self.sigma == 0 or count <= 1:
            return float(min(self.mean, self.max))
        mu = self.mu
        z = NormalDist().inv_cdf(1 - 1 / (count + 1))
        return min(float(self.max), math.exp(mu + self.sigma * z))
