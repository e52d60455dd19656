"""Response lengths of a step's prompt groups whose siblings are alike, and a rollout pool that decodes them.

GRPO samples G responses per prompt; their lengths share the prompt's difficulty (Seer, arXiv 2511.14617:
"requests sharing the same prompt exhibit strong similarities in output lengths"). With the trace's
log-normal (``ResponseLength``: mean, sigma, clipped at max) and a sibling correlation ρ of log lengths,

    log L = μ + σ (√ρ · Z_prompt + √(1 − ρ) · Z_response),   μ the trace's (``spec.response.lognormal_mu``),

so the marginal of one response is the trace's log-normal for every ρ, and a group finishes with its
longest response. Expectations over Z_prompt use equally weighted normal quantiles (deterministic).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, wraps
from statistics import NormalDist

import numpy as np

from nereus.cost.decode import DecodePhases, Replica, decode_phases
from nereus.spec.response import ResponseLength, lognormal_mu

_NORMAL = NormalDist()
_SQRT2 = math.sqrt(2.0)  # as statistics.NormalDist.cdf divides by it: the fast paths below give its very bits
PROMPT_POINTS = 64  # quantiles of Z_prompt the expectations average over
# bisection steps in log length: from [1, 2^20] tokens to within a factor 1 + 1e-8 (a ten-thousandth of
# a token at 20k tokens)
QUANTILE_STEPS = 32
LENGTH_POINTS = 16  # quantiles of a length distribution handed to the decode model (as cost.stages does)


def _memoized(method: Callable) -> Callable:
    """A pure method of a frozen ``GroupLengths`` with its answers kept on the instance: every lever and
    every plan the controller prices asks the same quantiles (their bisections were half of the start-of-run
    choice at 1,024 GPUs), and the instance cannot change under them."""

    @wraps(method)
    def cached(self: GroupLengths, *args: float) -> object:
        key = (method.__name__, args)
        if key not in self.answers:
            self.answers[key] = method(self, *args)
        return self.answers[key]

    return cached


@dataclass(frozen=True)
class GroupLengths:
    """Lengths of groups of ``group_size`` responses with sibling correlation ``siblings`` (ρ)."""

    mean: float
    max: int
    sigma: float
    siblings: float
    group_size: int
    answers: dict = field(default_factory=dict, init=False, compare=False, hash=False, repr=False)

    @staticmethod
    def of(resp: ResponseLength, siblings: float, group_size: int) -> GroupLengths:
        return GroupLengths(resp.mean, resp.max, resp.sigma, siblings, max(1, group_size))

    @cached_property
    def mu(self) -> float:
        return lognormal_mu(self.mean, self.sigma, self.max)

    @cached_property
    def prompt_z(self) -> tuple[float, ...]:
        return tuple(_NORMAL.inv_cdf((j + 0.5) / PROMPT_POINTS) for j in range(PROMPT_POINTS))

    @cached_property
    def _spread(self) -> float:
        """σ √(1 − ρ): the spread of log L given the prompt's Z."""
        return self.sigma * math.sqrt(1 - self.siblings)

    @cached_property
    def _centres(self) -> tuple[float, ...]:
        """μ + σ √ρ z_j: the centre of log L given each prompt quantile z_j."""
        return tuple(self.mu + self.sigma * math.sqrt(self.siblings) * z for z in self.prompt_z)

    def prompt_cdfs(self, x: float) -> list[float]:
        """``response_cdf(x, z_j)`` for every prompt quantile z_j, the very same numbers, computed in one pass
        (the bisections of the levers' quantiles evaluate this millions of times)."""
        if x >= self.max or x <= 0 or self.sigma == 0:
            return [self.response_cdf(x, z) for z in self.prompt_z]
        lx, spread, erf = math.log(x), self._spread, math.erf
        if spread < 1e-9:
            return [1.0 if lx >= c else 0.0 for c in self._centres]
        return [0.5 * (1.0 + erf((lx - c) / spread / _SQRT2)) for c in self._centres]

    def response_cdf(self, x: float, z: float | None = None) -> float:
        """P(L ≤ x) for one response, given the prompt's Z (or marginally when ``z`` is None)."""
        if x >= self.max:
            return 1.0
        if x <= 0:
            return 0.0
        if self.sigma == 0:
            return 1.0 if x >= self.mean else 0.0
        if z is None:
            return _NORMAL.cdf((math.log(x) - self.mu) / self.sigma)
        spread = self.sigma * math.sqrt(1 - self.siblings)
        centre = self.mu + self.sigma * math.sqrt(self.siblings) * z
        if spread < 1e-9:
            return 1.0 if math.log(x) >= centre else 0.0
        return _NORMAL.cdf((math.log(x) - centre) / spread)

    def group_cdf(self, x: float) -> float:
        """P(a group's longest response ≤ x) = E_Z[F(x | Z)^G]."""
        g = self.group_size
        return sum(f ** g for f in self.prompt_cdfs(x)) / PROMPT_POINTS

    @_memoized
    def group_quantile(self, q: float) -> float:
        """The length by which a share ``q`` of the groups has finished (bisection on ``group_cdf``)."""
        return float(self.max) if q >= 1 else self._quantile(self.group_cdf, q)

    def _quantile(self, cdf: Callable[[float], float], q: float) -> float:
        """The length at which ``cdf`` reaches ``q`` (bisection in log length; the max if it never does)."""
        lo, hi = 1.0, float(self.max)
        if cdf(hi * (1 - 1e-9)) < q:
            return hi
        for _ in range(QUANTILE_STEPS):
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if cdf(mid) < q else (lo, mid)
        return hi

    @_memoized
    def longest(self, count: int) -> float:
        """Expected longest of ``count`` responses (the 1 − 1/(count+1) quantile of the marginal)."""
        return self._quantile(self.response_cdf, 1 - 1 / (count + 1))

    @_memoized
    def response_quantiles(self, points: int = LENGTH_POINTS) -> tuple[float, ...]:
        return tuple(self._quantile(self.response_cdf, (i + 0.5) / points) for i in range(points))

    def deferred_weights(self, stop: float) -> tuple[float, ...]:
        """P(Z_prompt = z_j | the prompt's group had not finished by ``stop``), over the prompt quantiles."""
        raw = [1 - f ** self.group_size for f in self.prompt_cdfs(stop)]
        total = sum(raw)
        return tuple(r / total for r in raw) if total > 0 else tuple(1 / PROMPT_POINTS for _ in raw)

    def deferred_cdf(self, x: float, stop: float, weights: tuple[float, ...] | None = None) -> float:
        """P(L ≤ x) for a fresh response to a prompt whose group had not finished by ``stop``: the prompt's
        difficulty stays, so with ρ > 0 its new responses are long too (``weights``: ``deferred_weights``
        of ``stop``, when the caller has them)."""
        w = self.deferred_weights(stop) if weights is None else weights
        return sum(wj * f for wj, f in zip(w, self.prompt_cdfs(x), strict=True) if wj > 0)

    @_memoized
    def deferred_quantiles(self, stop: float, points: int = LENGTH_POINTS) -> tuple[float, ...]:
        w = self.deferred_weights(stop)
        return tuple(self._quantile(lambda x: self.deferred_cdf(x, stop, w), (i + 0.5) / points)
                     for i in range(points))

    @_memoized
    def deferred_longest(self, stop: float, count: int) -> float:
        """Expected longest of ``count`` fresh responses to deferred prompts (the 1 − 1/(count+1) quantile)."""
        w = self.deferred_weights(stop)
        return self._quantile(lambda x: self.deferred_cdf(x, stop, w), 1 - 1 / (count + 1))

    @_memoized
    def kept_mean(self, stop: float) -> float:
        """Mean length of a response whose group finished by ``stop`` (the groups a short round keeps)."""
        q = self.response_quantiles(LENGTH_POINTS * 4)
        num = den = 0.0
        for z in self.prompt_z:
            done = self.response_cdf(stop, z) ** self.group_size
            if done <= 0:
                continue
            # Given Z and the whole group ≤ stop, each response is the conditional below stop.
            inside = self.response_cdf(stop, z)
            mean_below = _mean_below(self, z, stop, inside, q)
            num += done * mean_below
            den += done
        return num / den if den > 0 else stop


def _mean_below(g: GroupLengths, z: float, stop: float, inside: float, grid: tuple[float, ...]) -> float:
    """E[L | L ≤ stop, Z = z] by the trapezoid rule on the response CDF over a length grid."""
    if inside <= 0:
        return stop
    xs = [x for x in (1.0, *grid) if x < stop] + [stop]
    total, prev_x, prev_f = 0.0, xs[0], g.response_cdf(xs[0], z)
    for x in xs[1:]:
        f = g.response_cdf(x, z)
        total += (f - prev_f) * (x + prev_x) / 2
        prev_x, prev_f = x, f
    return total / inside


@dataclass(frozen=True)
class RolloutPool:
    """``replicas`` copies of one inference replica, each with ``slots`` sequences in flight at most,
    decoding a round's sequences split evenly (``nereus.cost.decode.decode_phases`` per replica).
    ``padded``: a fixed batch that keeps every sequence in its forward until the round's longest ends
    (each priced at that length)."""

    replica: Replica
    replicas: int
    slots: int
    prompt: float
    padded: bool = False

    def phases(self, sequences: float, lengths: tuple[float, ...], mean: float, longest: float) -> DecodePhases:
        if self.padded:
            lengths, mean = (longest,) * len(lengths), longest
        per = max(1, math.ceil(sequences / max(1, self.replicas)))
        return decode_phases(self.replica, self.prompt, per, max(1, min(self.slots, per)), tuple(sorted(lengths)),
                             mean, longest)

    def seconds(self, sequences: float, lengths: tuple[float, ...], mean: float, longest: float) -> float:
        return self.phases(sequences, lengths, mean, longest).total_s


def sibling_correlation(lengths: Sequence[float], group_size: int) -> float | None:
    """The correlation of log response lengths between siblings (responses to one prompt: ``group_size``
    consecutive entries), measured as the one-way intraclass correlation ICC(1) (Shrout & Fleiss 1979,
    https://doi.org/10.1037/0033-2909.86.2.420): (MSB − MSW) / (MSB + (g − 1)·MSW), clipped to [0, 1).
    ``GroupLengths.siblings`` is this ρ. None without two whole groups or any spread to measure."""
    g = group_size
    n = len(lengths) // g if g > 1 else 0
    if n < 2:
        return None
    logs = np.log(np.maximum(1.0, np.asarray(lengths[: n * g], float))).reshape(n, g)
    means = logs.mean(axis=1)
    msb = g * float(((means - logs.mean()) ** 2).sum()) / (n - 1)
    msw = float(((logs - means[:, None]) ** 2).sum()) / (n * (g - 1))
    if msb + (g - 1) * msw <= 0:
        return None
    return min(max((msb - msw) / (msb + (g - 1) * msw), 0.0), 0.99)


@dataclass(frozen=True)
class MeasuredLengths:
    """Response lengths of prompt groups as a backend measured them (``groups``: each group's sibling
    lengths; ``max``: the job's length limit), answering what ``GroupLengths`` answers from its log-normal
    but from the draws themselves: a task whose lengths follow another law (the ``repeat`` task's capped
    discrete Pareto, ``rl.longtail``) is priced on what it does. A deferred prompt regenerated afresh is
    taken to repeat its measured group's lengths (sibling correlation 1: the runtime measures 0.8–0.95 on
    that task)."""

    groups: tuple[tuple[float, ...], ...]
    max: int

    @cached_property
    def _matrix(self) -> np.ndarray:
        """The groups as rows (every group has the job's ``samples_per_prompt`` siblings)."""
        return np.asarray(self.groups, float)

    @cached_property
    def _responses(self) -> np.ndarray:
        return self._matrix.ravel()

    @cached_property
    def _group_max(self) -> np.ndarray:
        return self._matrix.max(axis=1)

    @property
    def group_size(self) -> int:
        return len(self.groups[0])

    @property
    def mean(self) -> float:
        return float(self._responses.mean())

    def response_quantiles(self, points: int = LENGTH_POINTS) -> tuple[float, ...]:
        return _quantiles(self._responses, points)

    def group_quantile(self, q: float) -> float:
        """The length by which a share ``q`` of the measured groups had finished."""
        return float(self.max) if q >= 1 else float(np.quantile(self._group_max, q))

    def longest(self, count: int) -> float:
        """The 1 − 1/(count+1) quantile of the measured responses (``GroupLengths.longest``'s rule)."""
        return float(np.quantile(self._responses, 1 - 1 / (count + 1)))

    def kept_mean(self, stop: float) -> float:
        """Mean length of the responses of groups that had finished by ``stop``."""
        kept = self._split(stop)[0]
        return float(kept.mean()) if kept.size else stop

    def deferred_quantiles(self, stop: float, points: int = LENGTH_POINTS) -> tuple[float, ...]:
        deferred = self._split(stop)[1]
        return _quantiles(deferred, points) if deferred.size else (float(stop),) * points

    def deferred_longest(self, stop: float, count: int) -> float:
        deferred = self._split(stop)[1]
        return float(np.quantile(deferred, 1 - 1 / (count + 1))) if deferred.size else float(stop)

    def _split(self, stop: float) -> tuple[np.ndarray, np.ndarray]:
        """The responses of the groups finished by ``stop`` and of the others."""
        done = self._group_max <= stop
        return self._matrix[done].ravel(), self._matrix[~done].ravel()


def _quantiles(values: np.ndarray, points: int) -> tuple[float, ...]:
    """``points`` equally weighted quantiles of ``values`` (the midpoints, as ``GroupLengths``'s)."""
    return tuple(float(x) for x in np.quantile(values, [(i + 0.5) / points for i in range(points)]))


def measured_groups(lengths: Sequence[float], group_size: int) -> tuple[tuple[float, ...], ...]:
    """A step's response lengths (``group_size`` consecutive rows per prompt) as groups; a partial group
    at the end is left out."""
    g = max(1, group_size)
    n = len(lengths) // g
    return tuple(tuple(float(x) for x in lengths[i * g:(i + 1) * g]) for i in range(n))
