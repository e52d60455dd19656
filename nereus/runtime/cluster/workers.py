"""The runtime: Ray actors (``worker.Worker``), one per device, joined into one torch.distributed world;
models load onto them under a layout, several layouts coexisting (each under its own key, with its own
process groups). Its methods are typed: each names one operation and returns its result.

Driver-side calls are typed requests (``calls``): ``submit`` issues one on every worker of a key's layout,
``submit_all`` on every worker of the world, and each request calls its ``Worker`` method by name.

``Runtime`` starts a local Ray instance by default (loopback only, no dashboard) or joins the cluster at
``address``. On a cluster of several nodes (``nodes``) workers are pinned to nodes so that TP groups stay
inside one, worlds meet at a store on the head node, and snapshots are copied to a second node. Workers
use gloo on CPU and NCCL with one GPU each when CUDA is present. Every call that creates groups goes to
all workers, because torch.distributed creates each group collectively.

``Runtime`` composes one mixin per role (``runtime_roles``: training, inference, transitions, recovery,
over the workers, key records and calls of ``runtime_roles.core.RuntimeCore``) with the generation part,
which is still written out here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nereus.runtime.capability import CAPABILITY
from nereus.runtime.cluster.calls import Generate, GenerateWithLogprobs
from nereus.runtime.cluster.runtime_roles.core import RuntimeCore
from nereus.runtime.cluster.runtime_roles.inference import InferenceOps
from nereus.runtime.cluster.runtime_roles.recovery import RecoveryOps
from nereus.runtime.cluster.runtime_roles.training import TrainingOps
from nereus.runtime.cluster.runtime_roles.transitions import TransitionOps
from nereus.runtime.cluster.worker import Worker, WorldAborted
from nereus.runtime.engines.sampling import SamplingParams
from nereus.runtime.hosts.nodes import PlacementError
from nereus.runtime.recovery.failover import WorkerLostError

if TYPE_CHECKING:
    from nereus.runtime.engines.protocol import EngineConfig, EnginesOpened

__all__ = ["PlacementError", "Runtime", "Worker", "WorkerLostError", "WorldAborted"]


class Runtime(TrainingOps, InferenceOps, TransitionOps, RecoveryOps, RuntimeCore):
    """``world`` workers (Ray actors) in one process group; ``load`` places a model under a layout. A lost
    worker raises ``WorkerLostError``; ``recover`` continues on the survivors (``failover``).
    ``capability`` says which layouts it runs; ``specs`` (key → ``KeySpec``) is what each key holds.
    Its roles' operations come from the mixins; the generation part is below."""

    capability = CAPABILITY

    # ----- generation (the engines' part of the runtime) -----------------------------------------------
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
