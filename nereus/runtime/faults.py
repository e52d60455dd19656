"""Fault injection for tests and benchmarks: a ``FaultPlan`` handed to the runtime says which worker dies
at which named point; production code only calls ``FaultHook.at(point)``, which does nothing unless the
plan armed that point on this worker.

Points (where a lost worker hurts most):
- ``"train_step"``: after the backward pass, before the optimizer step (gradient all-reduces done, the
  ZeRO shards not yet updated);
- ``"transition"``: in a live transition after every worker voted to commit, while the transfers run.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

POINTS = ("train_step", "transition")


@dataclass(frozen=True)
class Fault:
    """Worker ``worker`` (its rank in the runtime) is SIGKILLed when it next reaches ``point``."""

    worker: int
    point: str

    def __post_init__(self) -> None:
        if self.point not in POINTS:
            raise ValueError(f"unknown fault point {self.point!r}; one of {list(POINTS)}")


@dataclass(frozen=True)
class FaultPlan:
    """The faults a test injects (``Runtime.inject``)."""

    faults: tuple[Fault, ...]

    @staticmethod
    def kill(worker: int, point: str) -> FaultPlan:
        return FaultPlan((Fault(worker, point),))

    def points_of(self, worker: int) -> list[str]:
        return [f.point for f in self.faults if f.worker == worker]


class FaultHook:
    """A worker's armed fault points; each fires once (the process ends with it)."""

    def __init__(self) -> None:
        self.armed: set[str] = set()

    def arm(self, points: list[str]) -> None:
        for p in points:
            Fault(0, p)  # validates the name
        self.armed |= set(points)

    def at(self, point: str) -> None:
        """A named point on a production path: SIGKILL this process if a fault plan armed it here."""
        if point in self.armed:
            self.armed.discard(point)
            os.kill(os.getpid(), signal.SIGKILL)
