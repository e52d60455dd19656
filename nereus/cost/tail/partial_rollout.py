"""Partial rollout (Kimi k1.5, arXiv 2501.12599; APRIL, arXiv 2509.18521): a per-step token budget, the
unfinished responses carried to the next step, each token tagged with the policy version that made it.

Each step every response in flight gains at most ``round_tokens`` (T) tokens; a response of length L is
trained in the step it ends, after ceil(L / T) steps, so its last L − (ceil(L/T) − 1)·T tokens have
policy lag 0, the T before them lag 1, and so on. In steady state a step trains S = P·G responses and
keeps S · E[ceil(L / T)] in flight (Little's law); the round decodes one chunk of each — T tokens, or a
response's remainder — all starting together, so the round ends with its longest chunk (T) instead of
the step's longest response: the tail shrinks to at most T tokens. A carried response re-reads its
context on resume (the weights changed: its KV cache is recomputed, one prefill of the tokens so far).
APRIL's rule (over-provision, stop once S have finished) settles at the budget where S responses end per
step, the same steady state; ``policy_lag`` bounds T from below: T ≥ max / (lag + 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from nereus.cost.decode import prefill_time
from nereus.cost.tail.lengths import LENGTH_POINTS, GroupLengths, RolloutPool


@dataclass(frozen=True)
class PartialRolloutEstimate:
    round_tokens: int
    round_s: float  # generation seconds per step (decode of every chunk in flight, plus re-prefill)
    plain_s: float  # the synchronous round it replaces (every response to its end, same S a step)
    in_flight: float  # responses in flight per step
    lag_shares: tuple[float, ...]  # share of trained tokens with policy lag 0, 1, 2, ...
    carried_share: float  # share of trained responses started in an earlier step

    @property
    def max_lag(self) -> int:
        return len(self.lag_shares) - 1

    @property
    def mean_lag(self) -> float:
        return sum(j * s for j, s in enumerate(self.lag_shares))

    @property
    def speedup(self) -> float:
        return self.plain_s / self.round_s


def budget_for_lag(max_length: int, policy_lag: int) -> int:
    """The smallest per-step token budget with every token at most ``policy_lag`` steps old."""
    return math.ceil(max_length / (policy_lag + 1))


def _chunks(length: float, budget: int) -> list[float]:
    """A response's per-step pieces, newest first: the remainder (lag 0), then T per earlier step."""
    steps = max(1, math.ceil(length / budget))
    return [length - (steps - 1) * budget] + [float(budget)] * (steps - 1)


def partial_rollout(pool: RolloutPool, lengths: GroupLengths, responses: int,
                    round_tokens: int) -> PartialRolloutEstimate:
    """Price a step of partial rollout training ``responses`` a step with a per-step budget of ``round_tokens``."""
    budget = max(1, min(int(round_tokens), lengths.max))
    q = lengths.response_quantiles(LENGTH_POINTS * 4)
    per_length = [_chunks(x, budget) for x in q]
    lag_tokens = [0.0] * max(len(c) for c in per_length)
    for chunks in per_length:
        for j, c in enumerate(chunks):
            lag_tokens[j] += c
    total = sum(lag_tokens)
    steps_in_flight = sum(len(c) for c in per_length) / len(per_length)
    in_flight = responses * steps_in_flight
    chunk_lengths = [c for chunks in per_length for c in chunks]
    pieces = tuple(sorted(chunk_lengths)[int((i + 0.5) * len(chunk_lengths) / LENGTH_POINTS)]
                   for i in range(LENGTH_POINTS))
    chunk_mean = sum(chunk_lengths) / len(chunk_lengths)
    decode = pool.seconds(in_flight, pieces, chunk_mean, float(max(chunk_lengths)))
    # Each carried piece re-reads what its response generated so far: one prefill of those tokens,
    # spread over the pool's replicas.
    carried_tokens = responses * sum(sum(c[1:]) for c in per_length) / len(per_length)
    context = pool.prompt + chunk_mean
    reprefill = prefill_time(pool.replica, carried_tokens / max(1, pool.replicas), context) if carried_tokens else 0.0
    plain = pool.seconds(responses, lengths.response_quantiles(), lengths.mean, lengths.longest(responses))
    carried = sum(1 for c in per_length if len(c) > 1) / len(per_length)
    return PartialRolloutEstimate(budget, decode + reprefill, plain, in_flight,
                                  tuple(t / total for t in lag_tokens), carried)


def best_budget(pool: RolloutPool, lengths: GroupLengths, responses: int, policy_lag: int,
                candidates: int = 6) -> PartialRolloutEstimate:
    """The fastest per-step budget whose tokens are at most ``policy_lag`` steps old (lag 0: the whole
    response in one step, i.e. off), among budgets from that bound up to the maximum length."""
    low = budget_for_lag(lengths.max, policy_lag)
    budgets = sorted({low, *(int(low + (lengths.max - low) * i / (candidates - 1)) for i in range(candidates))})
    return min((partial_rollout(pool, lengths, responses, b) for b in budgets), key=lambda e: e.round_s)


def steady_round(lengths: np.ndarray, prompt: float, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """A step's generation round in steady state under a per-step budget T, at sequence granularity: the
    responses of a draw like this one longer than T resume (their remaining tokens after a context of
    prompt + T, re-prefilled), the new ones decode min(L, T) after the prompt. Returns (tokens to decode,
    context) per sequence, resumed ones first (for ``cost.generation.run_bulk``)."""
    longer = lengths[lengths > budget]
    resumed = longer - budget
    tokens = np.concatenate([resumed, np.minimum(lengths, float(budget))])
    context = np.concatenate([np.full(len(resumed), prompt + budget), np.full(len(lengths), prompt)])
    return tokens, context
