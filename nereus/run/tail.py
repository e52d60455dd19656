"""Tail batching in the RL step (``run.rollout.tail_batching``; RollPacker, arXiv 2509.21009).

A short round launches ``over_launch`` × the step's prompts (the step's own draws plus spare draws) and
keeps the first step's worth of whole GRPO groups to finish; the engine aborts the others
(``decode_engine.first_groups``) and their prompts are deferred. Once a step's worth of deferred prompts
has accumulated, the next step is a long round: it regenerates them from scratch and runs to the end.
Every trained token comes from the current policy (policy lag 0); only the order in which prompts are
trained changes. Each data-parallel replica keeps its own share of groups, so the launched and kept
group counts are multiples of the generation stage's DP degree.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from nereus.rl.data import Prompt
from nereus.spec.levers import TailBatching


@dataclass(frozen=True)
class TailRound:
    """One step's generation round: the prompts launched (one per group), how many groups each replica
    keeps (0: all, a long round), and whether it is a long round."""

    launched: list[Prompt]
    keep_per_replica: int
    long: bool


@dataclass
class TailRounds:
    """The deferred prompts and the next round. ``draining``: the lever is off (the plan's levers turned
    it off), and the prompts it deferred get long rounds, topped up with spare draws, until none is left."""

    spec: TailBatching
    deferred: list[Prompt] = field(default_factory=list)
    draining: bool = False

    def plan(self, fresh: list[Prompt], spare: Callable[[int], list[Prompt]], dp: int) -> TailRound:
        """The round of a step whose own draws are ``fresh``; ``spare(n)``: ``n`` extra draws."""
        per = len(fresh)
        if per % dp:
            raise ValueError(f"tail batching keeps whole groups per replica: {per} prompts per step do not "
                             f"split over the generation stage's dp={dp}")
        if len(self.deferred) >= per or self.draining:  # a long round: the deferred prompts, from scratch
            launched, self.deferred = self.deferred[:per], self.deferred[per:]
            return TailRound(launched + spare(per - len(launched)), 0, True)
        launch = dp * math.ceil(per * self.spec.over_launch / dp)
        launched = list(fresh) + spare(launch - per)
        return TailRound(launched, per // dp, False)

    def settle(self, launched: list[Prompt], kept: list[bool]) -> None:
        """After a short round: the prompts of the groups the engine aborted wait for a long round."""
        self.deferred += [p for p, k in zip(launched, kept, strict=True) if not k]
