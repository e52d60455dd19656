"""Partial rollout in the RL step (``run.rollout.partial_rollout`` under ``run.policy_lag: 1``).

A round launches ``over_launch`` × the step's prompt groups and stops once a step's worth of whole groups
has finished (APRIL, arXiv 2509.18521; Kimi k1.5's partial rollouts, arXiv 2501.12599). Unlike tail
batching, the unfinished groups' responses are not thrown away: they are carried to the next step and
resumed there — their prompt and generated tokens re-prefilled under the new weights, the rest generated
by the new policy. Every token is tagged with the policy version (step) that produced it, so a trained
response may mix two versions; each step records the lag of its training tokens
(``rollout/policy_lag_mean``, ``rollout/policy_lag_max``). A carried group must finish in the next step
(the engine keeps it whatever its finish order: ``first_groups``'s ``must``), so the lag is at most 1; that
needs ``over_launch`` ≤ 2 (a replica carries at most as many groups as it keeps).

Each data-parallel replica keeps and carries its own groups: its slice of the next launch starts with the
groups it carried, followed by fresh ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from nereus.rl.data import Prompt
from nereus.runtime.engines.answers import Carried


@dataclass(frozen=True)
class CarriedGroup:
    """A group a round aborted: its prompt, its rows' partial answers, and the step that generated them."""

    prompt: Prompt
    rows: tuple[Carried, ...]
    step: int


@dataclass(frozen=True)
class PartialRound:
    """A round's launch: one prompt per group, the carried group (or None) in each slot, per replica."""

    launched: list[Prompt]
    carried: list[CarriedGroup | None]
    keep_per_replica: int
    must_per_replica: int


@dataclass
class PartialRollouts:
    over_launch: float
    carried: list[list[CarriedGroup]] = field(default_factory=list)  # per replica

    def plan(self, fresh: list[Prompt], spare: Callable[[int], list[Prompt]], dp: int) -> PartialRound:
        per = len(fresh)
        if per % dp:
            raise ValueError(f"partial rollout keeps whole groups per replica: {per} prompts per step do not "
                             f"split over the generation stage's dp={dp}")
        slot = math.ceil(per * self.over_launch / dp)  # groups per replica
        carried = self.carried if len(self.carried) == dp else [[] for _ in range(dp)]
        must = max(map(len, carried))
        if must > per // dp:
            raise ValueError("a replica carries more groups than it keeps: over_launch must be at most 2")
        need = sum(slot - len(c) for c in carried)
        pool = iter(list(fresh) + spare(max(0, need - per)))
        launched: list[Prompt] = []
        slots: list[CarriedGroup | None] = []
        for c in carried:
            launched += [g.prompt for g in c] + [next(pool) for _ in range(slot - len(c))]
            slots += list(c) + [None] * (slot - len(c))
        # the carried groups come first in each replica's slice; a replica with fewer pads with fresh ones,
        # which it must then keep too (``must`` is one number for every replica)
        return PartialRound(launched, slots, per // dp, must)

    def settle(self, rnd: PartialRound, answers: list, group_size: int, dp: int, step: int) -> None:
        """The groups of this round the engine aborted, carried to the next step, per replica."""
        per_replica = len(rnd.launched) // dp
        self.carried = [[] for _ in range(dp)]
        for g, prompt in enumerate(rnd.launched):
            rows = answers[g * group_size: (g + 1) * group_size]
            if isinstance(rows[0], Carried):
                self.carried[g // per_replica].append(CarriedGroup(prompt, tuple(rows), step))


def resumed_inputs(rnd: PartialRound, prompt_ids: list[list[int]], group_size: int,
                   ) -> tuple[list[list[int]], tuple[int, ...], frozenset[int]]:
    """Each row's engine prompt (its carried tokens appended), carried token counts, rows already done."""
    ids, counts, done = [], [], set()
    for r, p in enumerate(prompt_ids):
        group = rnd.carried[r // group_size]
        row = group.rows[r % group_size] if group is not None else None
        ids.append(list(p) + (row.tokens if row else []))
        counts.append(len(row.tokens) if row else 0)
        if row is not None and row.done:
            done.add(r)
    return ids, tuple(counts), frozenset(done)


def stitch(rnd: PartialRound, answer: tuple[list[int], list[float]], row: int, group_size: int,
           step: int) -> tuple[list[int], list[float], list[int]]:
    """A kept row's whole response: carried tokens then new ones, their log-probs and policy versions."""
    group = rnd.carried[row // group_size]
    tokens, logps = answer
    if group is None:
        return list(tokens), list(logps), [step] * len(tokens)
    old = group.rows[row % group_size]
    return (old.tokens + list(tokens), old.logprobs + list(logps),
            [group.step] * len(old.tokens) + [step] * len(tokens))
