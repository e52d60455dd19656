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
from dataclasses import dataclass, field

import ray
from ray import ObjectRef
from ray.actor import ActorHandle

from nereus.runtime.transitions.live import KeySpec


class WorkerLostError(RuntimeError):
    """One or more workers died; ``Runtime.recover`` continues on the survivors."""

    def __init__(self, lost: list[int], cause: str) -> None:
        super().__init__(f"lost worker(s) {lost}: {cause}")
        self.lost = lost


@dataclass(frozen=True)
class RecoveryResult:
    """What ``Runtime.recover`` did: the workers lost and left, the step the state is at, the seconds it
    took (re-forming the world, then restoring the state), which models came from live replicas and which
    from the snapshot only, the nodes lost and how many images were read from their copies."""

    lost: tuple[int, ...]
    workers: int
    resume_step: int | None
    wall_s: float
    world_s: float
    restore_s: float
    live_state: tuple[str, ...]
    snapshot_only: tuple[str, ...]
    lost_nodes: tuple[str, ...] = ()
    images_from_copies: int = 0

    def to_dict(self) -> dict:
        """The run's record of it (``recoveries`` in the job's state; JSON)."""
        return {"lost": list(self.lost), "workers": self.workers, "resume_step": self.resume_step,
                "wall_s": self.wall_s, "live_state": list(self.live_state), "snapshot_only": list(self.snapshot_only),
                "lost_nodes": list(self.lost_nodes), "images_from_copies": self.images_from_copies,
                "world": self.world_s, "restore": self.restore_s}


@dataclass(frozen=True)
class ImageCopy:
    """A snapshot image's copy on another node (several nodes only)."""

    ref: ObjectRef  # the copy
    node: str  # the Ray node that holds it
    ack: ObjectRef | None = None  # its acknowledgement: in once the copy is, an error if the image failed


@dataclass(frozen=True)
class PendingSnapshot:
    """A snapshot being taken: it counts once every image (and, on several nodes, every copy) is in."""

    step: int
    images: dict[str, list[ObjectRef]]  # model -> one state-image ref per worker
    homes: dict[str, list[str]]  # model -> the node of each image (several nodes only)
    copies: dict[str, list[ImageCopy]] = field(default_factory=dict)  # model -> each image's copy

    def complete(self) -> list[ObjectRef]:
        """What is in once every image is: with copies, their acknowledgements (which fail if the image
        failed; the images stay on their nodes), else the images."""
        acks = [c.ack for cs in self.copies.values() for c in cs if c.ack is not None]
        return acks or [r for rs in self.images.values() for r in rs]


class Failover:
    """The driver's failover state: the snapshots (one state-image ref per worker and model), the models
    changed since the newest one, and the calls abandoned when a loss showed. Methods take the runtime's
    current workers and key specs, which ``Runtime`` alone owns."""

    def __init__(self) -> None:
        self.dirty: set[str] = set()  # models whose state changed since the newest snapshot
        self.snapshots: dict[str, list[ObjectRef]] = {}  # model → one state-image ref per worker (complete)
        self.homes: dict[str, list[str]] = {}  # model → the node of each of its images (several nodes only)
        self.replicas: dict[str, list[ImageCopy]] = {}  # model → each image's copy (several nodes)
        self.refresh: set[str] = set()  # frozen models whose images must be taken again (a node was lost)
        self.from_copies = 0  # images the last recovery read from their copies (their node was lost)
        self.snapshot_step: int | None = None
        self._pending: PendingSnapshot | None = None  # a snapshot being taken
        self._in_flight: list[ObjectRef] = []  # calls still out when a loss showed, collected by ``settle_in_flight``
        self.timeout_s: float | None = None  # the owner's deadline for a wait (``get``) that names none

    def changed(self, model: str) -> None:
        """``model``'s state is about to change (a training step): it is no longer the snapshot's."""
        self.dirty.add(model)

    # ----- detection ------------------------------------------------------------------------------
    @staticmethod
    def lost_workers(workers: list[ActorHandle], timeout_s: float = 10.0) -> list[int]:
        """Ranks whose actor is dead or does not answer on its control thread within ``timeout_s``."""
        pings = [w.pid.remote() for w in workers]
        lost = []
        for rank, ref in enumerate(pings):
            try:
                ray.get(ref, timeout=timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                lost.append(rank)
        return lost

    def get(self, workers: list[ActorHandle], refs: list[ObjectRef], timeout_s: float | None = None) -> list:
        """``ray.get(refs)``, but a lost worker raises ``WorkerLostError`` as soon as it shows (a dead
        actor, or a survivor's collective failing) instead of waiting on survivors blocked on it; past
        ``timeout_s`` in all, ``waits.WaitTimeout`` (every wait reaches the driver)."""
        from nereus.runtime.hosts.waits import WaitTimeout

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

    def snapshot(self, step: int, workers: list[ActorHandle], specs: Iterable[KeySpec], homes: list[str] | None = None,
                 ring: dict[str, str] | None = None) -> float:
        """Copy the state a lost worker could take with it (trained models every call, frozen ones once)
        to host memory, labelled ``step``; returns the seconds the driver spent. The copies are taken by
        each worker before its next call (calls run in order), while the driver goes on; the snapshot counts
        once every copy is in (at the next snapshot, or at a recovery if they all made it). With ``homes``
        (each worker's node) and ``ring`` (node → node its images are copied to), every image is also
        copied to its node's successor."""
        from nereus.runtime.hosts.nodes import replicate

        t0 = time.perf_counter()
        specs = list(specs)
        self.settle(workers)
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
            copies: dict[str, list[ImageCopy]] = {}
            if ring and homes:
                for m, rs in refs.items():
                    copies[m] = []
                    for r, h in zip(rs, homes, strict=True):
                        copy, ack = replicate(r, ring[h])
                        copies[m].append(ImageCopy(copy, ring[h], ack))
            self._pending = PendingSnapshot(step, refs, {m: list(homes or []) for m in models}, copies)
        self.dirty.clear()
        return time.perf_counter() - t0

    def settle(self, workers: list[ActorHandle]) -> None:
        """Wait for the snapshot being taken and make it the one recovery uses (a worker lost before its
        image is in makes recovery fall back to the snapshot before: ``recovery_sources``)."""
        if self._pending is not None:
            self.get(workers, self._pending.complete())
            self._promote(self._pending)

    @property
    def latest_snapshot_step(self) -> int | None:
        """The step of the newest snapshot taken or being taken."""
        return self._pending.step if self._pending else self.snapshot_step

    def _promote(self, pending: PendingSnapshot) -> None:
        """Make ``pending`` the snapshot recovery uses (its images are in)."""
        self._pending = None
        self.snapshots.update(pending.images)
        self.homes.update(pending.homes)
        self.replicas.update(pending.copies)
        self.refresh -= set(pending.images)
        self.snapshot_step = pending.step

    # ----- recovery -------------------------------------------------------------------------------
    def recovery_sources(self, workers: list[ActorHandle], specs: list[KeySpec], lost: Iterable[int] = (),
                         alive: set[str] | None = None) -> set[str]:
        """Before re-forming the world: settle the newest snapshot (``lost``: the ranks lost; ``alive``: the
        nodes known to be up, None on one node) and return the models whose live state changed since it
        (they come from the snapshot only); raises ``StateLostError`` when one of them has no snapshot."""
        from nereus.runtime.recovery.snapshots import StateLostError

        pending, self._pending = self._pending, None
        if pending is not None and _all_in(readable_images(pending, set(lost), alive)):
            self._promote(pending)
        elif pending is not None:
            # the newest snapshot cannot be read whole (its worker died first): the one before it, from
            # which every trained model has changed since
            self.dirty |= _trained_models(specs)
        missing = sorted(m for m in self.dirty if m not in self.snapshots)
        if missing:
            raise StateLostError(f"{missing} changed since the job started and no snapshot holds them: take "
                                 "snapshots (run.checkpoint.snapshot_every) to survive a lost worker")
        return set(self.dirty)

    def images(self, survivors: list[ActorHandle], specs: list[KeySpec], dirty: set[str],
               alive: set[str] | None = None) -> dict[str, list[ObjectRef]]:
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

    def _snapshot_images(self, model: str, alive: set[str] | None) -> list[ObjectRef]:
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
            elif i < len(copies) and copies[i].node in alive:
                out.append(copies[i].ref)
                self.from_copies += 1
        return out

    def recovered(self, node_lost: bool = False) -> None:
        """The survivors hold the snapshot's state: nothing has changed since it. After a lost node every
        frozen model's images are taken again at the next snapshot (theirs had one copy left)."""
        self.dirty.clear()
        if node_lost:
            self.refresh |= set(self.snapshots)


PROMOTE_WAIT_S = 60.0  # for the images still being written when a loss showed (a busy machine: seconds)


@dataclass(frozen=True)
class Voucher:
    """What says a pending snapshot's image can be read: ``ref`` is in and, with ``check``, did not fail
    (``ray.get`` on it raises the image's error)."""

    ref: ObjectRef
    check: bool


def readable_images(pending: PendingSnapshot, lost: set[int], alive: set[str] | None) -> list[Voucher] | None:
    """One voucher per image of ``pending`` (image ``i`` of a model is rank ``i``'s), or None when an image
    is on no node in ``alive``. A survivor's image on a live node is in once its ref is (the survivor ran
    ``state_images`` before the call in flight, so it did not fail); else its copy's acknowledgement on a live node
    (tiny; it fails if the image did); else the image itself on its live node, read to see it did not fail.
    A lost node's copies do not matter when the image they copy is readable."""
    out = []
    for model, refs in pending.images.items():
        homes, copies = pending.homes.get(model) or [], pending.copies.get(model) or []
        for rank, ref in enumerate(refs):
            home_up = alive is None or not homes or homes[rank] in alive
            if home_up and rank not in lost:
                out.append(Voucher(ref, check=False))
            elif rank < len(copies) and alive is not None and copies[rank].node in alive and copies[rank].ack:
                out.append(Voucher(copies[rank].ack, check=True))
            elif home_up:
                out.append(Voucher(ref, check=True))
            else:
                return None
    return out


def _all_in(vouchers: list[Voucher] | None) -> bool:
    """Every voucher in within ``PROMOTE_WAIT_S`` and none of those checked failed."""
    if vouchers is None:
        return False
    refs = [v.ref for v in vouchers]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PROMOTE_WAIT_S, fetch_local=False)
    if len(ready) < len(refs):
        return False
    try:
        ray.get([v.ref for v in vouchers if v.check])
    except ray.exceptions.RayError:
        return False
    return True


def _models(specs: list[KeySpec]) -> list[str]:
    return sorted({s.model for s in specs})


def _trained_models(specs: list[KeySpec]) -> set[str]:
    return {s.model for s in specs if s.training}


def _keys_of(specs: list[KeySpec], model: str, training_only: bool = False) -> dict[str, str]:
    """key → model for ``model``'s keys (only its training key with ``training_only``)."""
    return {s.key: model for s in specs if s.model == model and (s.training or not training_only)}
