"""The ``Worker``'s recovery role: host-memory images of its state (snapshots, and the live replicas a
recovery reads), a re-formed world joined with the shards kept, and every key restored from images."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import ray
from ray import ObjectRef

from nereus.runtime.cluster.worker_roles.core import WorkerCore

if TYPE_CHECKING:
    from nereus.runtime.recovery.snapshots import StateImage
    from nereus.runtime.transitions.live import KeySpec


class RecoveryRole(WorkerCore):
    """Reads ``models`` into state images (``recovery.snapshots``); ``reinit`` leaves the world for a new
    one (``rank``, ``world``, ``groups``, ``pending``, ``comm``, the abort flag and the abandoned calls
    reset, ``models`` kept, the generation role's engines that ran in the world dropped:
    ``drop_world_engines``); ``restore`` replaces ``models`` and ``groups`` from images, with the groups
    ``prepare_groups`` left in ``pending``, and closes the generation role's engines (``close_engines``):
    the driver opens them anew on the new layout."""

    def reinit(self, master: str, port: int, world: int, timeout_s: float, rank: int | None = None) -> bool:
        """Leave the current world (every group with it) and join one of ``world`` workers as ``rank``
        (default: the same), keeping this worker's shards in memory; ``regroup`` then rebuilds them on the
        new world's groups. Calls abandoned by ``abort`` fail once their world is gone."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        # An abandoned call fails once gloo notices its world is gone, which can take seconds (its peer's
        # socket is dead, not closed): it touches nothing the recovery rebuilds, so it is not waited for beyond
        # a short grace, and is left behind, still listed, if alive.
        deadline = time.monotonic() + 0.25
        for t in self._stuck:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        self._stuck = [t for t in self._stuck if t.is_alive()]
        self._abort.clear()
        self.world, self.groups, self.pending = world, {}, {}
        self.drop_world_engines()
        self.rank = self.rank if rank is None else rank
        self.init_dist(master, port, timeout_s)
        return self.init_comm(min(timeout_s, 120.0))

    def state_image(self, key_model: dict[str, str], optimizer_for: list[str], weights_dp0_only: bool) -> StateImage:
        """A copy of this worker's state of the keys in ``key_model`` (``recovery.state_image``); as a
        return value it lives in Ray's object store, owned by the driver: a host-memory snapshot that
        outlives this process."""
        from nereus.runtime.recovery.snapshots import state_image

        return state_image(self.models, key_model, set(optimizer_for), weights_dp0_only)

    def state_images(self, models: list[str], keys: dict[str, dict[str, str]],
                     optimizer_for: list[str]) -> StateImage | tuple[StateImage, ...]:
        """``state_image`` of each of ``models`` (its keys in ``keys``), one return value each (a snapshot:
        data-parallel replica 0's weights, every rank's optimizer state)."""
        images = tuple(self.state_image(keys[m], optimizer_for, True) for m in models)
        return images if len(images) > 1 else images[0]

    def holdings(self, key: str, model: str) -> StateImage:
        """A state image (``recovery.state_image``) of ``key``: weights and Adam state by global box."""
        return self.state_image({key: model}, [model], False)

    def restore(self, specs: list[KeySpec], images: dict[str, list[ObjectRef]]) -> bool:
        """Replace every key by ``specs`` (groups from ``prepare_groups`` in the re-formed world), each
        buffer filled from ``images`` (model → object refs of state images, in preference order)."""
        from nereus.runtime.recovery.snapshots import restore_state

        pending, self.pending = self.pending, {}
        self.close_engines()  # their keys are rebuilt on a new layout: the driver opens engines anew
        fetched = {m: ray.get(refs) for m, refs in images.items()}
        models = restore_state(specs, pending, fetched, self.comm)
        self.models, self.groups = models, dict(pending)
        return True
