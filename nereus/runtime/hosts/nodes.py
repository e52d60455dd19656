"""The runtime on a Ray cluster of several nodes: which node each worker runs on, where a new world meets,
and where each snapshot's second copy goes.

*Placement* (``NodeMap``): ranks fill the cluster's nodes in order, each to its worker slots (CPUs, or
GPUs with CUDA), every worker pinned to its node (``NodeAffinitySchedulingStrategy``, not soft). Ranks are
numbered tensor-parallel innermost (``Layout.rank``: ``(pp·dp + d)·tp + t``), so a TP group of ``tp``
consecutive ranks stays inside a node whenever ``tp`` divides the node's slots — the Megatron-LM rule
(Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters", §3.3: TP within a
node's NVLink domain). ``tp_split`` names a layout whose TP group would cross nodes, so the runtime
refuses it rather than run it over the slow link.

*Rendezvous* (``RendezvousStore``): one ``torch.distributed.TCPStore`` hosted by a small actor pinned to the
head node, at the head's address every node reaches; each world (start, resize, recovery) meets under a
fresh key prefix of it, so nothing depends on a shared file system or on a worker that may be lost.

*Replicas* (``replica_ring``): a snapshot image lives in the object store of its worker's node; losing the
node loses it. Each image is also copied to the next node of a ring over the workers' nodes (and the
driver's), as Gemini does for in-memory checkpoints (Wang et al. 2023, "Gemini: Fast Failure Recovery in
Distributed Training with In-Memory Checkpoints", SOSP, §4: replicas on other machines), so a lost node's
snapshots are read from its neighbour.
"""

from __future__ import annotations

import socket
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import ray
from ray import ObjectRef
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from nereus.spec.errors import SpecError
from nereus.spec.layout import Layout

if TYPE_CHECKING:
    import torch.distributed as dist
    from ray._private.node import Node as RayNode
    from ray.cluster_utils import Cluster


HEAD_RESOURCE = "node:__internal_head__"  # the resource Ray gives the head node only
STORE_SCHEME = "store://"


class PlacementError(SpecError):
    """The cluster cannot host the workers asked for, or a layout's TP group would cross nodes (a bad
    input: the CLI prints it as one line naming the key, ``run.workers`` unless told otherwise)."""

    def __init__(self, message: str, path: str = "run.workers") -> None:
        super().__init__(path, message)


@dataclass(frozen=True)
class NodeSlots:
    """One alive Ray node: its id, its address, how many workers it can host, whether it is the head."""

    node_id: str
    ip: str
    slots: int
    head: bool


def alive_nodes(resource: str) -> list[NodeSlots]:
    """Ray's alive nodes with their worker slots (the node's total ``resource``: "CPU" or "GPU"), the head
    first, then by address and id (a stable order: the same cluster gives the same placement)."""
    out = []
    for n in ray.nodes():
        if n.get("Alive"):
            res = n.get("Resources", {})
            out.append(NodeSlots(n["NodeID"], n["NodeManagerAddress"], int(res.get(resource, 0)), HEAD_RESOURCE in res))
    return sorted(out, key=lambda n: (not n.head, n.ip, n.node_id))


def several_nodes() -> bool:
    """True when the connected Ray cluster has more than one alive node."""
    return sum(1 for n in ray.nodes() if n.get("Alive")) > 1


class NodeMap:
    """The node of each worker, by rank (``homes``), and the choice of nodes for workers that join."""

    def __init__(self, resource: str) -> None:
        self.resource = resource
        self.homes: list[str] = []
        # nodes whose every worker was lost: never chosen again (Ray may list a dead node as alive until
        # its health checks time out, tens of seconds; a restarted node comes back under a new id)
        self.lost: set[str] = set()

    def place(self, count: int) -> list[str]:
        """Nodes for ``count`` new workers (ranks ``len(homes)`` on): the nodes in ``alive_nodes`` order, each
        filled to its slots after the workers it already hosts. Raises ``PlacementError`` when the cluster
        has fewer free slots, naming what it has."""
        nodes = [n for n in alive_nodes(self.resource) if n.node_id not in self.lost]
        used = {n.node_id: self.homes.count(n.node_id) for n in nodes}
        free = [n.node_id for n in nodes for _ in range(max(0, n.slots - used[n.node_id]))]
        if len(free) < count:
            have = ", ".join(f"{n.ip}/{n.node_id[:8]}: {n.slots}" for n in nodes)
            raise PlacementError(f"{len(self.homes) + count} workers need one {self.resource} each; "
                                 f"the Ray cluster has {sum(n.slots for n in nodes)} ({have}): add nodes or run "
                                 "fewer workers")
        chosen = free[:count]
        self.homes += chosen
        return chosen

    def drop(self, ranks: list[int]) -> list[str]:
        """Workers ``ranks`` are lost; the others are renumbered in order (as the runtime renumbers them).
        Returns the nodes left without a worker, taken for lost."""
        gone = set(ranks)
        before = set(self.homes)
        self.homes = [h for r, h in enumerate(self.homes) if r not in gone]
        emptied = sorted(before - set(self.homes))
        self.lost |= set(emptied)
        return emptied

    def truncate(self, n: int) -> None:
        self.homes = self.homes[:n]


def pinned(node_id: str) -> dict:
    """Ray actor/task options that run it on ``node_id`` and nowhere else."""
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


def tp_groups(layout: Layout, ranks: list[int]) -> list[list[int]]:
    """The worker ranks of each TP group of ``layout`` on ``ranks`` (``ParallelDims.group_members``, as
    ``groups.ParallelGroups`` forms them)."""
    return layout.dims.group_members("tp", ranks)


def tp_split(layout: Layout, ranks: list[int], homes: list[str]) -> str | None:
    """Why ``layout`` cannot run on workers ``ranks`` given each worker's node (``homes``): a TP group
    across nodes; else None."""
    if not homes:
        return None
    for group in tp_groups(layout, ranks):
        nodes = sorted({homes[r][:8] for r in group if r < len(homes)})
        if len(nodes) > 1:
            return (f"layout {layout.short()} puts TP group {group} on nodes {nodes}; tensor parallelism "
                    f"stays inside a node: give it ranks of one node (ranks fill nodes in order) or a smaller tp")
    return None


# ----- rendezvous ------------------------------------------------------------------------------------
@ray.remote(num_cpus=0)
class RendezvousStore:
    """A ``TCPStore`` server on the node this actor runs on (the head); worlds meet under their own prefix."""

    def __init__(self, timeout_s: float) -> None:
        import torch.distributed as dist

        self.ip = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(self.ip, 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeout_s))

    def address(self) -> tuple[str, int]:
        return self.ip, self.store.port


def start_store(timeout_s: float) -> ActorHandle:
    """The rendezvous store's actor, on the head node (or the driver's node when no head is visible)."""
    nodes = alive_nodes("CPU")
    head = next((n.node_id for n in nodes if n.head), ray.get_runtime_context().get_node_id())
    return RendezvousStore.options(**pinned(head)).remote(timeout_s)


def world_address(store: ActorHandle) -> str:
    """A fresh meeting point for one world: ``store://ip:port/world-<uuid>``."""
    ip, port = ray.get(store.address.remote(), timeout=60)
    return f"{STORE_SCHEME}{ip}:{port}/world-{uuid.uuid4().hex}"


def open_store(address: str, timeout_s: float) -> dist.Store:
    """The worker side of ``world_address``: a client of the head's store under the world's prefix."""
    import torch.distributed as dist

    hostport, _, prefix = address.removeprefix(STORE_SCHEME).partition("/")
    host, _, port = hostport.rpartition(":")
    client = dist.TCPStore(socket.gethostbyname(host), int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(prefix, client)


# ----- snapshot replicas -----------------------------------------------------------------------------
def replica_ring(homes: list[str], driver_node: str) -> dict[str, str]:
    """node → the node its snapshots are copied to: the next in a ring over the workers' nodes (in rank
    order), with the driver's node in the ring too; empty on one node (nothing to copy to)."""
    ring = list(dict.fromkeys(homes))
    if driver_node not in ring:
        ring.append(driver_node)
    if len(ring) < 2:
        return {}
    return {node: ring[(i + 1) % len(ring)] for i, node in enumerate(ring)}


@ray.remote(num_cpus=0, num_returns=2, max_retries=0)
def _copy(image: object) -> tuple[object, bool]:
    """``image`` (a worker's state image) again, stored on the node this task runs on, and a small
    acknowledgement the driver waits for (so that the image itself is never pulled to the driver)."""
    return image, True


def replicate(ref: ObjectRef, node: str) -> tuple[ObjectRef, ObjectRef]:
    """(the copy's ref, its acknowledgement's ref): ``ref``'s object copied into ``node``'s object store."""
    image, ack = _copy.options(**pinned(node)).remote(ref)
    return image, ack


# ----- a cluster of several nodes on one machine (tests, benchmarks, trying it out) ----------------------
def start_local_cluster(worker_nodes: int, cpus_per_node: int, head_cpus: int = 0,
                        system_config: dict | None = None) -> tuple[Cluster, list[RayNode]]:
    """A Ray cluster of a head (``head_cpus``: 0 keeps workers off it) and ``worker_nodes`` nodes of
    ``cpus_per_node`` CPUs, each its own raylet and object store, all on this machine and on loopback
    (``ray.cluster_utils.Cluster``); the driver is connected to it. Returns (cluster, worker nodes):
    ``cluster.remove_node(node, allow_graceful=False)`` kills a node's raylet, store and workers."""
    import os

    from ray.cluster_utils import Cluster

    from nereus.runtime.hosts.raylocal import LOOPBACK, LOOPBACK_ENV

    os.environ.update(LOOPBACK_ENV)  # every node's processes on loopback, as ``raylocal.start_local_ray``
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    head = {"num_cpus": head_cpus, "include_dashboard": False, "node_ip_address": LOOPBACK}
    if system_config:
        head["_system_config"] = system_config
    cluster = Cluster(initialize_head=True, head_node_args=head)
    nodes = [cluster.add_node(num_cpus=cpus_per_node, node_ip_address=LOOPBACK) for _ in range(worker_nodes)]
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster, nodes
