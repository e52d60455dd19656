"""Fault injection for tests and benchmarks: a ``FaultPlan`` handed to the runtime says which worker does
what at which named point; production code only calls ``FaultHook.at(point)``, which does nothing unless
the plan armed that point on this worker.

Points (where a fault hurts most):
- ``"backward"``: in the middle of the backward pass, when the first parameter's gradient is computed (before
  the gradient all-reduces: the other ranks wait in them);
- ``"train_step"``: after the backward pass, before the optimizer step (gradient all-reduces done, the
  ZeRO shards not yet updated);
- ``"transition.prepare"``, ``"transition.transfer"``, ``"transition.install"``: the phases of a live
  transition before its commit point (``runtime.transitions.executor``);
- ``"sync.prepare"``, ``"sync.transfer"``, ``"sync.install"``: the same phases of the per-step weight sync
  from a training layout to the model's other layouts, which runs through the same executor;
- ``"migration.transfer"``, ``"migration.install"``: a live migration of unfinished sequences before its
  commit point (``runtime.engines.native.kv_migrate``): before this worker posts its messages, after they all landed;
- ``"generate"``: a rollout engine's replica in the middle of decoding: the native engine after its first
  decode iteration (prompts prefilled, tokens being sampled), a vLLM engine's replica while its engine
  generates.

Actions: ``kill`` SIGKILLs the worker's process (a lost worker: ``Runtime.recover``); ``fail`` raises
``InjectedFault`` there (a transition that fails before its commit point must leave the old layout).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

POINTS = ("backward", "train_step", "transition.prepare", "transition.transfer", "transition.install",
          "sync.prepare", "sync.transfer", "sync.install", "migration.transfer", "migration.install", "generate")
ACTIONS = ("kill", "fail")


class InjectedFault(RuntimeError):
    """A ``fail`` fault fired."""


@dataclass(frozen=True)
class Fault:
    """Worker ``worker`` (its rank in the runtime) meets ``action`` when it next reaches ``point``."""

    worker: int
    point: str
    action: str = "kill"

    def __post_init__(self) -> None:
        if self.point not in POINTS:
            raise ValueError(f"unknown fault point {self.point!r}; one of {list(POINTS)}")
        if self.action not in ACTIONS:
            raise ValueError(f"unknown fault action {self.action!r}; one of {list(ACTIONS)}")


@dataclass(frozen=True)
class FaultPlan:
    """The faults a test injects (``Runtime.inject``)."""

    faults: tuple[Fault, ...]

    @staticmethod
    def kill(worker: int, point: str) -> FaultPlan:
        return FaultPlan((Fault(worker, point, "kill"),))

    @staticmethod
    def fail(worker: int, point: str) -> FaultPlan:
        return FaultPlan((Fault(worker, point, "fail"),))

    def actions_of(self, worker: int) -> dict[str, str]:
        """Point → action for ``worker``."""
        return {f.point: f.action for f in self.faults if f.worker == worker}


class FaultHook:
    """A worker's armed fault points; each fires once."""

    def __init__(self) -> None:
        self.armed: dict[str, str] = {}

    def arm(self, actions: dict[str, str]) -> None:
        for point, action in actions.items():
            Fault(0, point, action)  # validates the names
        self.armed.update(actions)

    def armed_at(self, point: str) -> bool:
        """Whether a fault waits at ``point`` (a hot path installs its hook only then)."""
        return point in self.armed

    def at(self, point: str) -> None:
        """A named point on a production path: act if a fault plan armed it here."""
        action = self.armed.pop(point, None)
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "fail":
            raise InjectedFault(f"injected failure at {point!r}")
