"""Recovery from lost workers, the driver side: ``Failover`` (owned by ``workers.Runtime``) holds what
detection and snapshots need; ``Runtime.recover`` re-forms the world the job continues on with it.

*Detection*: every call the runtime waits for is collected as it completes; an actor that died, or a
collective that failed, makes the runtime ping every worker on its control thread (which answers even
while its call is blocked on the lost peer) and raise ``WorkerLostError`` naming the lost ranks.

*Snapshots*: ``snapshot`` copies each trained model's weights (one data-parallel replica) and Adam state,
and once each frozen model's weights, into Ray's object store as return values the driver owns — host
memory that outlives any worker process. On a cluster of several nodes each image is also copied to
another node (``nodes.replica_ring``), so a lost node — its raylet, object store and workers — is
recovered like a lost worker: its images are read from their copies.

*Recovery* (``recover``): the survivors abandon the call in flight, re-form a world of their own, and
load the layouts the caller chooses for them; each buffer is filled from the survivors' live state where
it is unchanged since the snapshot (data-parallel replicas of what the lost worker held), else from the
snapshot. The job is then at the snapshot's step, and redoes the steps after it — at most the step in
flight when snapshots are taken every step.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import ray

from nereus.runtime.transitions.live import KeySpec


class WorkerLostError(RuntimeError):
    """One or more workers died; ``Runtime.recover`` continues on the survivors."""

    def __init__(self, lost: list[int], cause: str) -> None:
        super().__init__(f"lost worker(s) {lost}: {cause}")
        self.lost = lost


class Failover:
    """The driver's failover state: the snapshots (one state-image ref per worker and model), the models
    changed since the newest one, and the calls abandoned when a loss showed. Methods take the runtime's
    current workers and key specs, which ``Runtime`` alone owns."""

    def __init__(self) -> None:
        self.dirty: set[str] = set()  # models whose state changed since the newest snapshot
        self.snapshots: dict[str, list] = {}  # model → one state-image ref per worker (complete)
        self.homes: dict[str, list[str]] = {}  # model → the node of each of its images (several nodes only)
        self.replicas: dict[str, list[tuple]] = {}  # model → (copy's ref, its node) per image (several nodes)
        self.refresh: set[str] = set()  # frozen models whose images must be taken again (a node was lost)
        self.from_copies = 0  # images the last recovery read from their copies (their node was lost)
        self.snapshot_step: int | None = None
        self._pending: tuple | None = None  # (step, refs, homes, replicas, acks) of a snapshot being taken
        self._in_flight: list = []  # calls still out when a loss showed, collected by ``settle_in_flight``
        self.timeout_s: float | None = None  # the owner's deadline for a wait (``get``) that names none

    def changed(self, model: str) -> None:
        """``model``'s state is about to change (a training step): it is no longer the snapshot's."""
        self.dirty.add(model)

    # ----- detection ------------------------------------------------------------------------------
    @staticmethod
    def lost_workers(workers: list, timeout_s: float = 10.0) -> list[int]:
        """Ranks whose actor is dead or does not answer on its control thread within ``timeout_s``."""
        pings = [w.pid.remote() for w in workers]
        lost = []
        for rank, ref in enumerate(pings):
            try:
                ray.get(ref, timeout=timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                lost.append(rank)
        return lost

    def get(self, workers: list, refs: list, timeout_s: float | None = None) -> list:
        """``ray.get(refs)``, but a lost worker raises ``WorkerLostError`` as soon as it shows (a dead
        actor, or a survivor's collective failing) instead of waiting on survivors blocked on it; past
        ``timeout_s`` in all, ``waits.WaitTimeout`` (every wait reaches the driver)."""
        from nereus.runtime.cluster.waits import WaitTimeout

        pending = list(refs)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                self._in_flight = pending
                raise WaitTimeout(f"{len(pending)} of {len(refs)} worker calls did not answer within {timeout_s:.0f} s "
                                  "(a worker hung); the run stops here instead of waiting forever")
            try:
                ray.get(ready[0])
            except ray.exceptions.RayActorError as exc:
                self._in_flight = pending  # answered by ``recover`` once the survivors let go
                raise WorkerLostError(self.lost_workers(workers) or ["?"], type(exc).__name__) from None
            except ray.exceptions.RayTaskError as exc:
                lost = self.lost_workers(workers)
                if lost:
                    self._in_flight = pending
                    raise WorkerLostError(lost, str(exc).splitlines()[-1][:200]) from None
                raise
        return ray.get(refs)

    def settle_in_flight(self) -> None:
        """Collect the abandoned calls' results (errors, once ``abort`` released them), so Ray does not
        report them as unhandled."""
        for ref in self._in_flight:
            try:
                ray.get(ref, timeout=10.0)
            except Exception:  # noqa: BLE001 - WorldAborted, a gloo error or the dead actor: all expected
                pass
        self._in_flight = []

    # ----- snapshots ------------------------------------------------------------------------------
    def forget(self) -> None:
        self.snapshots, self.snapshot_step, self._pending = {}, None, None
        self.homes, self.replicas, self.refresh = {}, {}, set()
        self.dirty.clear()

    def snapshot(self, step: int, workers: list, specs: Iterable[KeySpec], homes: list[str] | None = None,
                 ring: dict[str, str] | None = None) -> float:
        """Copy the state a lost worker could take with it (trained models every call, frozen ones once)
        to host memory, labelled ``step``; returns the seconds the driver spent. The copies are taken by
        each worker before its next call (calls run in order), while the driver goes on; the snapshot counts
        once every copy is in (at the next snapshot, or at a recovery if they all made it). With ``homes``
        (each worker's node) and ``ring`` (node → node its images are copied to), every image is also
        copied to its node's successor."""
        from nereus.runtime.cluster.nodes import replicate

        t0 = time.perf_counter()
        specs = list(specs)
        self._promote(workers, self._pending, wait=True)
        trained = _trained_models(specs)
        models = [m for m in _models(specs) if m in trained or m not in self.snapshots or m in self.refresh]
        if models:  # a trained model's training key holds what its other keys follow
            keys = {m: _keys_of(specs, m, training_only=m in trained) for m in models}
            opt = [m for m in models if m in trained]
            per_worker = [w.state_images.options(num_returns=len(models)).remote(models, keys, opt)
                          for w in workers]
            if len(models) == 1:
                per_worker = [[r] for r in per_worker]
            refs = {m: [refs[i] for refs in per_worker] for i, m in enumerate(models)}
            replicas: dict[str, list[tuple]] = {}
            acks = []
            if ring and homes:
                for m, rs in refs.items():
                    copies = [replicate(r, ring[h]) + (ring[h],) for r, h in zip(rs, homes, strict=True)]
                    replicas[m] = [(ref, node) for ref, _, node in copies]
                    acks += [ack for _, ack, _ in copies]
            self._pending = (step, refs, {m: list(homes or []) for m in models}, replicas, acks)
        self.dirty.clear()
        return time.perf_counter() - t0

    @property
    def latest_snapshot_step(self) -> int | None:
        """The step of the newest snapshot taken or being taken."""
        return self._pending[0] if self._pending else self.snapshot_step

    def _promote(self, workers: list, pending: tuple | None, wait: bool) -> bool:
        """Make a pending snapshot the one recovery uses, once each of its copies is in (``wait``: block
        for them; else only if they all already made it)."""
        if pending is None:
            return False
        self._pending = None
        step, refs, homes, replicas, acks = pending
        # with copies, their acknowledgements (which fail if the image failed): the images stay on their nodes
        flat = acks or [r for rs in refs.values() for r in rs]
        if wait:
            self.get(workers, flat)
        else:
            ready, _ = ray.wait(flat, num_returns=len(flat), timeout=5.0)
            try:
                ray.get(ready)
            except ray.exceptions.RayError:
                return False
            if len(ready) < len(flat):
                return False
        self.snapshots.update(refs)
        self.homes.update(homes)
        self.replicas.update(replicas)
        self.refresh -= set(refs)
        self.snapshot_step = step
        return True

    # ----- recovery -------------------------------------------------------------------------------
    def recovery_sources(self, workers: list, specs: list[KeySpec]) -> set[str]:
        """Before re-forming the world: settle the newest snapshot and return the models whose live state
        changed since it (they come from the snapshot only); raises ``StateLostError`` when one of them
        has no snapshot."""
        from nereus.runtime.recovery.snapshots import StateLostError

        if self._pending is not None and not self._promote(workers, self._pending, wait=False):
            # the newest snapshot is incomplete (its worker died first): the one before it, from which
            # every trained model has changed since
            self.dirty |= _trained_models(specs)
        missing = sorted(m for m in self.dirty if m not in self.snapshots)
        if missing:
            raise StateLostError(f"{missing} changed since the job started and no snapshot holds them: take "
                                 "snapshots (run.checkpoint.snapshot_every) to survive a lost worker")
        return set(self.dirty)

    def images(self, survivors: list, specs: list[KeySpec], dirty: set[str],
               alive: set[str] | None = None) -> dict[str, list]:
        """Per model, state images in preference order: the survivors' live state of models unchanged
        since the snapshot, then the snapshot — each image from a node in ``alive`` (nodes known to be up:
        the survivors' and the driver's), its copy when its own node may be lost."""
        trained = _trained_models(specs)
        images: dict[str, list] = {}
        self.from_copies = 0
        for model in _models(specs):
            live = []
            if model not in dirty:
                opt = [model] if model in trained else []
                live = [w.state_image.remote(_keys_of(specs, model), opt, False) for w in survivors]
            images[model] = live + self._snapshot_images(model, alive)
        return images

    def _snapshot_images(self, model: str, alive: set[str] | None) -> list:
        """``model``'s snapshot images, each read where it survives: on its own node when that node is up
        (or nothing says otherwise: one node), else from its copy on a node that is up; an image whose two
        nodes are both lost is left out (``recovery.fill`` then names what no image covers)."""
        refs, homes, copies = self.snapshots.get(model, []), self.homes.get(model, []), self.replicas.get(model, [])
        if alive is None or not homes:
            return list(refs)
        out = []
        for i, ref in enumerate(refs):
            if homes[i] in alive:
                out.append(ref)
            elif i < len(copies) and copies[i][1] in alive:
                out.append(copies[i][0])
                self.from_copies += 1
        return out

    def recovered(self, node_lost: bool = False) -> None:
        """The survivors hold the snapshot's state: nothing has changed since it. After a lost node every
        frozen model's images are taken again at the next snapshot (theirs had one copy left)."""
        self.dirty.clear()
        if node_lost:
            self.refresh |= set(self.snapshots)


def _models(specs: list[KeySpec]) -> list[str]:
    return sorted({s.model for s in specs})


def _trained_models(specs: list[KeySpec]) -> set[str]:
    return {s.model for s in specs if s.training}


def _keys_of(specs: list[KeySpec], model: str, training_only: bool = False) -> dict[str, str]:
    """key → model for ``model``'s keys (only its training key with ``training_only``)."""
    return {s.key: model for s in specs if s.model == model and (s.training or not training_only)}
