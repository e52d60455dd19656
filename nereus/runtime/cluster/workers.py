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

``Runtime`` composes one mixin per role (``runtime_roles``: training, inference, generation, transitions,
recovery), over the workers, key records and calls of ``runtime_roles.core.RuntimeCore``.
"""

from __future__ import annotations

from nereus.runtime.capability import CAPABILITY
from nereus.runtime.cluster.runtime_roles.core import RuntimeCore
from nereus.runtime.cluster.runtime_roles.generation import GenerationOps
from nereus.runtime.cluster.runtime_roles.inference import InferenceOps
from nereus.runtime.cluster.runtime_roles.recovery import RecoveryOps
from nereus.runtime.cluster.runtime_roles.training import TrainingOps
from nereus.runtime.cluster.runtime_roles.transitions import TransitionOps
from nereus.runtime.cluster.worker import Worker, WorldAborted
from nereus.runtime.hosts.nodes import PlacementError
from nereus.runtime.recovery.failover import WorkerLostError

__all__ = ["PlacementError", "Runtime", "Worker", "WorkerLostError", "WorldAborted"]


class Runtime(TrainingOps, InferenceOps, GenerationOps, TransitionOps, RecoveryOps, RuntimeCore):
    """``world`` workers (Ray actors) in one process group; ``load`` places a model under a layout. A lost
    worker raises ``WorkerLostError``; ``recover`` continues on the survivors (``failover``).
    ``capability`` says which layouts it runs; ``specs`` (key → ``KeySpec``) is what each key holds.
    Its operations are its roles'."""

    capability = CAPABILITY
