"""Tail batching (RollPacker, arXiv 2509.21009): over-launch, keep the first groups that finish, defer the
rest to dedicated long rounds. Sample order changes; the policy does not (policy lag 0).

A short round launches ``over_launch`` × P prompt groups and stops once P groups have finished: with
group completion lengths distributed as ``GroupLengths.group_cdf``, the P-th of fP groups finishes at
its 1/f quantile (the round's ``stop`` length). The (f − 1)·P unfinished groups are deferred whole
(GRPO needs every sibling of a group) and their partial responses discarded, so every trained token
comes from the current policy. Once P deferred groups have accumulated a long round regenerates them
from scratch: the prompts keep their difficulty (sibling correlation ρ), so the round is uniformly
long, its batch stays full for most of it, and a planner may give it its own layout (``long_pool``).
Each round is one training step of P groups; a cycle is one short round and f − 1 long rounds.
"""

from __future__ import annotations

from dataclasses import dataclass

from nereus.cost.tail.lengths import LENGTH_POINTS, GroupLengths, MeasuredLengths, RolloutPool

# a length model: the log-normal of the trace or job, or the lengths a backend measured
Lengths = GroupLengths | MeasuredLengths


@dataclass(frozen=True)
class Round:
    """One generation round: seconds, sequences, tokens generated and kept for training, its longest."""

    seconds: float
    sequences: float
    tokens: float
    kept_tokens: float
    longest: float


@dataclass(frozen=True)
class TailBatchingEstimate:
    over_launch: float
    stop_length: float  # the length by which a short round's kept groups have finished
    plain: Round  # the synchronous round it replaces: P groups, run to the longest response
    short: Round
    long: Round
    long_rounds_per_short: float  # f − 1: each short round defers (f − 1)·P groups, a long round takes P
    policy_lag: int = 0

    @property
    def mean_round_s(self) -> float:
        """Generation seconds per training step, over a cycle of one short and f − 1 long rounds."""
        n = self.long_rounds_per_short
        return (self.short.seconds + n * self.long.seconds) / (1 + n)

    @property
    def speedup(self) -> float:
        """Samples generated per second against the synchronous round (same P groups a step)."""
        return self.plain.seconds / self.mean_round_s

    @property
    def wasted_share(self) -> float:
        """Share of generated tokens discarded (the deferred groups' partial responses)."""
        n = self.long_rounds_per_short
        generated = self.short.tokens + n * self.long.tokens
        return 1 - (self.short.kept_tokens + n * self.long.kept_tokens) / generated


def plain_round(pool: RolloutPool, lengths: Lengths, groups: int) -> Round:
    """The synchronous round: ``groups`` × G responses, every one to its end (the step's longest)."""
    n = groups * lengths.group_size
    q = lengths.response_quantiles()
    longest = lengths.longest(n)
    tokens = n * lengths.mean
    return Round(pool.seconds(n, q, lengths.mean, longest), n, tokens, tokens, longest)


def tail_batching(pool: RolloutPool, lengths: Lengths, groups: int, over_launch: float,
                  long_pool: RolloutPool | None = None) -> TailBatchingEstimate:
    """Price tail batching for ``groups`` prompt groups a step launched ``over_launch`` × (≥ 1) at a time;
    ``long_pool`` is the layout of the long rounds (default: the same as the short rounds)."""
    f = max(1.0, over_launch)
    plain = plain_round(pool, lengths, groups)
    if f <= 1.0:
        return TailBatchingEstimate(1.0, plain.longest, plain, plain, plain, 0.0)
    stop = min(plain.longest, lengths.group_quantile(1 / f))
    n_short = f * groups * lengths.group_size
    clipped = tuple(min(x, stop) for x in lengths.response_quantiles(LENGTH_POINTS * 4))
    clipped_mean = sum(clipped) / len(clipped)
    kept = groups * lengths.group_size * lengths.kept_mean(stop)
    short = Round(pool.seconds(n_short, clipped, clipped_mean, stop), n_short, n_short * clipped_mean, kept, stop)
    n_long = groups * lengths.group_size
    deferred = lengths.deferred_quantiles(stop)
    deferred_mean = sum(deferred) / len(deferred)
    longest = lengths.deferred_longest(stop, n_long)
    long_seconds = (long_pool or pool).seconds(n_long, deferred, deferred_mean, longest)
    long = Round(long_seconds, n_long, n_long * deferred_mean, n_long * deferred_mean, longest)
    return TailBatchingEstimate(f, stop, plain, short, long, f - 1)


def best_over_launch(pool: RolloutPool, lengths: Lengths, groups: int,
                     candidates: tuple[float, ...] = (1.0, 1.25, 1.5, 2.0, 3.0),
                     long_pool: RolloutPool | None = None) -> TailBatchingEstimate:
    """The over-launch factor with the fastest mean round among ``candidates`` (1.0: off)."""
    return min((tail_batching(pool, lengths, groups, f, long_pool) for f in candidates),
               key=lambda e: e.mean_round_s)

