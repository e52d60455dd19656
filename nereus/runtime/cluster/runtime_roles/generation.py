"""The driver's generation operations on the ``Runtime``: fixed-batch generation on a key's replicas and
the rollout engines' lifecycle on every worker (``run.rollout.engine``; ``engines.registry``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nereus.runtime.cluster.calls import Generate, GenerateWithLogprobs
from nereus.runtime.cluster.runtime_roles.core import RuntimeCore
from nereus.runtime.engines.sampling import SamplingParams

if TYPE_CHECKING:
    from nereus.runtime.engines.protocol import EngineConfig, EnginesOpened


class GenerationOps(RuntimeCore):
    """Generation calls (``calls.Generate``, ``GenerateWithLogprobs``) and each key's engines: open, close,
    refresh in place, read back (tests)."""

    def generate(self, key: str, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        return [row for part in self._on(key, Generate(prompts, params)) for row in part]

    def generate_with_logprobs(self, key: str, prompts: list[list[int]],
                               params: SamplingParams) -> list[tuple[list[int], list[float]]]:
        """New tokens and their sampling-time log-probs per prompt (``generate.generate_with_logprobs``)."""
        return [row for part in self._on(key, GenerateWithLogprobs(prompts, params)) for row in part.rows]

    # ----- rollout engines of a generation key (run.rollout.engine; runtime.engines.registry) ------------
    def open_engine(self, key: str, config: EngineConfig) -> EnginesOpened:
        """The engine ``config.settings.engine`` on ``key``'s replicas (``Engine.open``: for vLLM one engine
        per data-parallel replica of the layout's TP size, ``config.tp``, loaded with the key's weights, a
        worker's idle engine of ``config`` where it has one, ``engines.pool``), and a bystander of the same
        kind on every other worker (a mid-step move's exchange and vote are world-wide); from then on the
        key's generation calls go to it. After a recovery or a transition the caller opens it again on the
        new layout (a re-formed world closes it). An open has the engine's own deadline
        (``Engine.start_s``: importing vLLM alone takes 10–30 s)."""
        from nereus.runtime.engines.protocol import EnginesOpened
        from nereus.runtime.engines.registry import engine_class

        start_s = engine_class(config.settings.engine).start_s
        refs = [w.engine_open.remote(key, config) for w in self.workers]
        return EnginesOpened.of(self.failover.get(self.workers, refs, max(self.timeout_s, start_s)))

    def close_engine(self, key: str) -> None:
        """Every worker's engine of ``key`` closed (a transition moved the key: engines open anew on it)."""
        self._all([w.close_engines.remote([key]) for w in self.workers], "close_engines")

    def update_engine(self, key: str) -> float:
        """The key's current weights into its engines in place (after ``sync_weights``); the slowest
        engine's reload seconds."""
        seconds = self._get([self.workers[r].engine_update.remote(key) for r in self.specs[key].ranks])
        return max((t for t in seconds if t is not None), default=0.0)

    def engine_tensors(self, key: str) -> list[dict[str, torch.Tensor] | None]:
        """Each worker's engine parameters in the engine's own layout, in layout rank order (tests)."""
        return self._get([self.workers[r].engine_tensors.remote(key) for r in self.specs[key].ranks])
