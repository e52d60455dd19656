"""Bounded waits of the driver on its workers (bounded work): every wait has a deadline that
reaches the driver as ``WaitTimeout`` naming the operation, and a join that Ray cannot place fails fast
with ``PlacementError`` naming the resource it lacks, before any existing worker is touched.

The hang this prevents: ``nereus scale 6`` on a Ray with 4 CPUs queued two actors that could never start;
the driver then waited without a deadline on calls to them, while the old workers gave up on the new
world after their own 600 s collective timeout — the driver never did.
"""

from __future__ import annotations

import ray

from nereus.runtime.hosts.nodes import PlacementError  # one error for "Ray cannot host these workers"
from nereus.spec.errors import RuntimeFailure

GRACE_S = 60.0  # beyond a worker's own collective timeout: a healthy call has answered (or failed) by then


class WaitTimeout(RuntimeFailure):
    """The driver waited longer than its deadline for workers' answers."""


def get_within(refs: list, timeout_s: float, what: str) -> list:
    """``ray.get(refs)`` within ``timeout_s``; else ``WaitTimeout`` naming ``what`` and how many answered."""
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    if pending:
        raise WaitTimeout(f"{what}: {len(pending)} of {len(refs)} workers did not answer within {timeout_s:.0f} s "
                          "(a worker hung or could not start); the run stops here instead of waiting forever")
    return ray.get(refs)


def resource_of(options: dict) -> tuple[str, float]:
    """The Ray resource one worker takes and how much of it, from its actor options (``num_cpus``/``num_gpus``)."""
    if options.get("num_gpus"):
        return "GPU", float(options["num_gpus"])
    return "CPU", float(options.get("num_cpus", 1))


def check_room(want: int, options: dict, have: int) -> None:
    """Refuse up front (``PlacementError``) to grow from ``have`` to ``want`` workers when Ray's whole
    cluster cannot hold ``want`` of them at once. (Free resources are not compared: those of workers just
    stopped come back a moment later; a join that fits the cluster but finds it busy is bounded by
    ``await_started`` instead.)"""
    resource, each = resource_of(options)
    total = ray.cluster_resources().get(resource, 0.0)
    fits = int(total // each + 1e-9)
    if want > fits:
        raise PlacementError(f"cannot grow to {want} workers: Ray has {total:g} {resource}s and each worker needs "
                             f"{each:g}, so at most {fits} fit; the run keeps its {have} (start Ray with more "
                             f"{resource}s, e.g. a larger run.max_workers)")


def await_started(actors: list, timeout_s: float) -> None:
    """Wait until every new actor answers (it was placed and started); else kill them all and raise
    ``PlacementError`` — they never joined a world, so the old one is untouched."""
    pings = [a.pid.remote() for a in actors]
    ready, pending = ray.wait(pings, num_returns=len(pings), timeout=timeout_s)
    if pending:
        for a in actors:
            ray.kill(a)
        raise PlacementError(f"{len(pending)} of {len(actors)} new worker(s) did not start within {timeout_s:.0f} s: "
                             "Ray could not place them (not enough free resources); the run keeps its workers")
    ray.get(ready)
