"""A worker's closed rollout engines that run in processes of their own (vLLM's), kept running for its next
engine of the same configuration.

Such an engine's start is its process, its package's import and the engine's build: 10-80 s for vLLM on
this CPU host, minutes on a GPU node (``cost.hardware.Priors.engine_start_s``); a weight reload into a
running engine takes well under a second (``reuse``). So an engine closed on a worker — by a recovery that
re-forms the world, a transition that moves the generation stage, or the end of a job on a runtime that
runs another — is kept idle, and the worker's next ``engine_open`` with an equal ``EngineConfig`` takes it
instead of starting one. Survivors of a lost worker and the replicas a move leaves on the same device at
the same TP thus keep their engines (``cost.transition.engines_rebuilt`` counts only the engines a move
starts).

On a GPU an idle engine holds its share of the device's memory, and a new engine's start checks the free
memory against ``gpu_memory_utilization``; so there, starting an engine of another configuration first
closes every idle one. On CPU each engine has a fixed KV cache of its own (``cpu_kv_cache_gib``). Either
way at most ``keep`` idle engines stay, the oldest closed first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from nereus.runtime.engines.protocol import EngineConfig


class Reusable(Protocol):
    """A running engine's handle that a new owner can take (``ReplicaEngine``)."""

    config: EngineConfig

    def reuse(self, weights: dict[str, torch.Tensor]) -> float: ...

    def close(self) -> None: ...


class IdleEngines:
    """Closed engines, oldest first, at most ``keep`` of them."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.engines: list[Reusable] = []

    def park(self, engine: Reusable) -> None:
        """``engine`` closed by its owner: kept for a later open, the oldest closed beyond ``keep``."""
        self.engines.append(engine)
        while len(self.engines) > self.keep:
            self.engines.pop(0).close()

    def open(self, config: EngineConfig, weights: dict[str, torch.Tensor],
             start: Callable[[EngineConfig, dict[str, torch.Tensor]], Reusable]) -> tuple[Reusable, bool]:
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
