"""Forecast of the coming workload from what the job measured and what it was told in advance.

Response lengths drift over a run (docs/sources/rl_length_dynamics.md: roughly linear growth over
thousands of steps, sometimes a dip after a context raise). The forecast fits a least-squares line to
the recent per-step means and extrapolates it to the middle of the horizon; the context limit (max
length) and GPU changes are announced by the job's schedule, not guessed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from nereus.spec.job import ResponseLength
from nereus.spec.trace import Trace


@dataclass
class LengthForecaster:
    window: int = 20
    sigma: float = 0.6

    def __post_init__(self) -> None:
        self._history: deque[tuple[int, float]] = deque(maxlen=self.window)

    def observe(self, step: int, mean: float) -> None:
        self._history.append((step, mean))

    def mean_at(self, step: int) -> float | None:
        """Least-squares linear trend of the recent means, evaluated at ``step``."""
        pts = list(self._history)
        if not pts:
            return None
        if len(pts) < 3:
            return pts[-1][1]
        n = len(pts)
        mx = sum(s for s, _ in pts) / n
        my = sum(m for _, m in pts) / n
        var = sum((s - mx) ** 2 for s, _ in pts)
        slope = sum((s - mx) * (m - my) for s, m in pts) / var if var else 0.0
        return max(1.0, my + slope * (step - mx))

    def response_at(self, step: int, context_limit: int) -> ResponseLength | None:
        mean = self.mean_at(step)
        if mean is None:
            return None
        return ResponseLength(min(mean, float(context_limit)), context_limit, "lognormal", self.sigma)


@dataclass(frozen=True)
class LengthSchedule:
    """What the job announces in advance: context-length stages and GPU availability."""

    trace: Trace | None = None
    default_max: int = 0

    def context_limit(self, step: int) -> int:
        return self.trace.response_at(step).max if self.trace else self.default_max

    def gpus(self, step: int, default: int) -> int:
        if self.trace is None:
            return default
        avail = default
        for s, n in self.trace.gpus:
            if s <= step:
                avail = n
        return avail
