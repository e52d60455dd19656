"""Partial rollout in the simulator's ground truth: responses carried from one step to the next.

With a plan's ``PartialRollout`` budget T the engine gives each new response at most T tokens this step
(vLLM's ``max_tokens`` per request); a response that has not ended by then keeps its tokens and resumes in
the next step, its context re-prefilled (the weights changed), and runs to its end there — so every
trained token is at most one step old (T ≥ max / 2 is the policy's to choose: ``cost.tail.partial_rollout``
``budget_for_lag``; a carried response is never cut twice). A step trains the responses that ended in it:
the new ones that fit in T and every carried one. Without a budget the carried ones (left from a step
that had one) simply finish. The backend keeps the carried responses between steps (``CarriedResponses``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CarriedResponses:
    """Responses in flight between steps: tokens still to generate and tokens generated so far."""

    remaining: np.ndarray
    generated: np.ndarray

    @staticmethod
    def none() -> CarriedResponses:
        return CarriedResponses(np.zeros(0), np.zeros(0))

    def __len__(self) -> int:
        return len(self.remaining)


@dataclass(frozen=True)
class GenerationRound:
    """One step's generation round: what every sequence decodes now after what context; which end in it."""

    lengths: np.ndarray  # tokens decoded this step, carried responses first
    contexts: np.ndarray  # prompt (+ tokens generated earlier, re-prefilled)
    carried_in: int  # the first ``carried_in`` sequences resume from the previous step
    trained_lengths: np.ndarray  # full response lengths of the responses that end this step
    lag1_tokens: float  # of their tokens, those generated in the previous step (policy lag 1)
    carried_out: CarriedResponses

    @property
    def trained(self) -> int:
        return len(self.trained_lengths)

    @property
    def policy_lag(self) -> tuple[float, ...]:
        total = float(self.trained_lengths.sum())
        if total <= 0 or self.lag1_tokens <= 0:
            return (1.0,)
        share = self.lag1_tokens / total
        return (1.0 - share, share)


def plan_round(new: np.ndarray, carried: CarriedResponses, prompt: float, budget: int | None) -> GenerationRound:
    """The round of ``new`` drawn lengths and the responses ``carried`` in, under a per-step budget."""
    cut = new if budget is None else np.minimum(new, float(budget))
    lengths = np.concatenate([carried.remaining, cut])
    contexts = np.concatenate([prompt + carried.generated, np.full(len(new), prompt)])
    ends = new <= cut
    trained = np.concatenate([carried.remaining + carried.generated, new[ends]])
    out = CarriedResponses(new[~ends] - cut[~ends], cut[~ends])
    return GenerationRound(lengths, contexts, len(carried), trained, float(carried.generated.sum()), out)
