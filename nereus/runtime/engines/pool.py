"""A worker's closed vLLM engines, kept running for its next engine of the same configuration.

A vLLM engine's start is its process, vLLM's import and the engine's build: 10-80 s on this CPU host,
minutes on a GPU node (``cost.hardware.Priors.engine_start_s``); a weight reload into a running
engine takes well under a second (``ReplicaEngine.reuse``). So an engine closed on a worker — by a
recovery that re-forms the world, a transition that moves the generation stage, or the end of a job on a
runtime that runs another — is kept idle, and the worker's next ``engine_open`` with an equal
``EngineConfig`` takes it instead of starting one. Survivors of a lost worker and the replicas a move
leaves on the same device at the same TP thus keep their engines (``cost.transition.engines_rebuilt``
counts only the engines a move starts).

On a GPU an idle engine holds its share of the device's memory, and a new engine's start checks the free
memory against ``gpu_memory_utilization``; so there, starting an engine of another configuration first
closes every idle one. On CPU each engine has a fixed KV cache of its own (``cpu_kv_cache_gib``). Either
way at most ``keep`` idle engines stay, the oldest closed first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

from nereus.runtime.engines.vllm_engine import EngineConfig, ReplicaEngine


class EngineOpened(Enum):
    """What a worker's ``engine_open`` did."""

    NONE = "none"  # no engine here: the key is not on this worker, or this is a TP rank > 0 of its replica
    STARTED = "started"
    REUSED = "reused"  # an idle engine of the same configuration took the weights


@dataclass(frozen=True)
class EnginesOpened:
    """The engines a ``Runtime.open_engine`` call started and reused."""

    started: int
    reused: int

    @staticmethod
    def of(answers: list[EngineOpened]) -> EnginesOpened:
        return EnginesOpened(answers.count(EngineOpened.STARTED), answers.count(EngineOpened.REUSED))


class IdleEngines:
    """Closed engines, oldest first, at most ``keep`` of them."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.engines: list[ReplicaEngine] = []

    def park(self, engine: ReplicaEngine) -> None:
        """``engine`` closed by its owner: kept for a later open, the oldest closed beyond ``keep``."""
        self.engines.append(engine)
        while len(self.engines) > self.keep:
            self.engines.pop(0).close()

    def open(self, config: EngineConfig, weights: dict[str, torch.Tensor],
             start: Callable[[EngineConfig, dict[str, torch.Tensor]], ReplicaEngine] = ReplicaEngine,
             ) -> tuple[ReplicaEngine, bool]:
        """An engine of ``config`` loaded with ``weights``, and whether it was an idle one (else ``start``ed:
        on a GPU after closing every idle engine). An idle engine whose process has died is dropped."""
        from ray.exceptions import RayActorError

        for engine in [e for e in self.engines if e.config == config]:
            self.engines.remove(engine)
            try:
                engine.reuse(weights)
                return engine, True
            except RayActorError:  # its process is gone: start one instead
                engine.close()
        if torch.cuda.is_available():
            self.close()
        return start(config, weights), False

    def close(self) -> None:
        while self.engines:
            self.engines.pop().close()
