"""The Ray actor of one device (``Worker``): holds the shards of every loaded model-stage by key, and
answers the runtime's typed calls on them; ``workers.Runtime`` drives a world of them.

Each operation on a key runs on every worker of the key's layout at once (collectives need all of
them); workers outside it answer None, and of a layout's workers only each data-parallel replica's output
rank (last pipeline stage, TP rank 0) returns a result, as ``calls.ReplicaOutput(dp, value)``.

``Worker`` composes one mixin per role (``worker_roles``: training, inference, generation, transitions,
recovery), over the shared state of ``worker_roles.core.WorkerCore``.
"""

from __future__ import annotations

import ray

from nereus.runtime.cluster.worker_roles.core import WorkerCore, WorldAborted
from nereus.runtime.cluster.worker_roles.generation import GenerationRole
from nereus.runtime.cluster.worker_roles.inference import InferenceRole
from nereus.runtime.cluster.worker_roles.recovery import RecoveryRole
from nereus.runtime.cluster.worker_roles.training import TrainingRole
from nereus.runtime.cluster.worker_roles.transitions import TransitionRole

__all__ = ["Worker", "WorldAborted"]


# Calls run one at a time, in order ("default" group); ``abort`` and ``pid`` answer from their own thread
# even while a call is blocked in a collective with a lost peer.
@ray.remote(concurrency_groups={"control": 1})
class Worker(TrainingRole, InferenceRole, GenerationRole, TransitionRole, RecoveryRole, WorkerCore):
    """One device: holds the shards of every loaded model-stage, keyed by name; its methods are its
    roles'."""
