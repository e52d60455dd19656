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
    from nereus.runtime.engines.engine_pool import EnginesOpened
    from nereus.runtime.engines.vllm_engine import EngineConfig

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

    # ----- vLLM engines of a generation key (run.rollout.engine: vllm; runtime.engines.vllm_engine) -----
    def open_engine(self, key: str, config: EngineConfig) -> EnginesOpened:
        """One vLLM engine per data-parallel replica of ``key`` (pp=1; the engine's TP size is the layout's,
        ``config.tp``), loaded with the key's weights: a worker's idle engine of ``config`` where it has one
        (``engine_pool``), else a new one; from then on ``generate_with_logprobs`` on ``key`` generates with
        them. After a recovery or a transition the caller opens them again on the new layout (a re-formed
        world closes them). An engine's start has its own deadline (``ENGINE_START_S``): importing vLLM
        alone takes 10–30 s."""
        from nereus.runtime.engines.engine_pool import EnginesOpened
        from nereus.runtime.engines.vllm_engine import ENGINE_START_S

        refs = [self.workers[r].engine_open.remote(key, config) for r in self.specs[key].ranks]
        return EnginesOpened.of(self.failover.get(self.workers, refs, max(self.timeout_s, ENGINE_START_S)))

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
