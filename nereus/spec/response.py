"""Response lengths of one RL step: the distribution the cost model and the traces share."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist


@lru_cache(maxsize=256)
def _lognormal_quantiles(mean: float, longest: int, sigma: float, points: int) -> tuple[float, ...]:
    if sigma == 0:
        return (float(min(mean, longest)),) * points
    mu = math.log(mean) - sigma**2 / 2  # so that E[len] = mean before clipping
    normal = NormalDist()
    return tuple(min(float(longest), math.exp(mu + sigma * normal.inv_cdf((i + 0.5) / points)))
                 for i in range(points))


@dataclass(frozen=True)
class ResponseLength:
    """Response lengths of one step: a log-normal with the given mean, clipped at ``max``.

    Published runs show a long right tail that sets the generation time (docs/sources/rl_length_dynamics.md:
    Seer, TLT); a log-normal with sigma ≈ 0.6–1 reproduces "the last 10% take up to half the time".
    """

    mean: float
    max: int
    distribution: str = "lognormal"
    sigma: float = 0.6

    def quantiles(self, points: int = 64) -> tuple[float, ...]:
        """``points`` equally weighted lengths (mid-quantiles), clipped at ``max``."""
        return _lognormal_quantiles(self.mean, self.max, self.sigma if self.distribution != "fixed" else 0.0,
                                    points)

    def longest(self, count: int) -> float:
        """Expected longest of ``count`` responses: the 1 − 1/(count+1) quantile, clipped at ``max``."""
        if self.distribution == "fixed" or self.sigma == 0 or count <= 1:
            return float(min(self.mean, self.max))
        mu = math.log(self.mean) - self.sigma**2 / 2
        z = NormalDist().inv_cdf(1 - 1 / (count + 1))
        return min(float(self.max), math.exp(mu + self.sigma * z))
