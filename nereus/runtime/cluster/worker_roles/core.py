"""What every role of the ``Worker`` actor shares: its place in the world, the shards it holds by key, and
the guard that lets a call blocked on a lost peer be abandoned.

Each data-parallel replica's output rank (last pipeline stage, TP rank 0) answers an operation on a key
with ``calls.ReplicaOutput(dp, value)``; every other worker answers None (``_on``, ``_output``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

import ray
import torch

from nereus.runtime.cluster.calls import ReplicaOutput
from nereus.runtime.comm.faults import FaultHook

if TYPE_CHECKING:
    from nereus.runtime.comm.groups import ParallelGroups
    from nereus.runtime.comm.transfer import TransferComm
    from nereus.runtime.parallel.sharded import ShardedModel

T = TypeVar("T")


class WorldAborted(RuntimeError):
    """The driver aborted this worker's world (a peer was lost); the call in flight was abandoned."""


class WorkerCore:
    """One device's place in the world and the state every role uses, initialised here only:

    * ``rank``, ``world``: this worker's rank in a torch.distributed world of ``world`` workers;
    * ``models``: key → this worker's shard (``ShardedModel``) of the key's model-stage;
    * ``groups``: key → the key's process groups (every worker of the world holds them, member or not);
    * ``pending``: a coming transition's or recovery's groups (``prepare_groups``);
    * ``comm``: the world's transfer groups (``init_comm``);
    * ``faults``: the fault hook, which does nothing unless a test's fault plan armed it;
    * ``_abort``, ``_stuck``: the abort flag and the calls ``abort`` abandoned, still blocked.

    Calls run one at a time, in order; ``pid``, ``abort`` and ``arm_faults`` answer from the actor's
    ``control`` concurrency group even while a call is blocked in a collective with a lost peer.
    """

    def __init__(self, rank: int, world: int) -> None:
        torch.set_num_threads(1)
        self.rank, self.world = rank, world
        self.models: dict[str, ShardedModel] = {}
        self.groups: dict[str, ParallelGroups] = {}
        self.pending: dict[str, ParallelGroups] = {}  # a coming transition's groups (``prepare_groups``)
        self.comm: TransferComm | None = None  # the world's transfer groups (``init_comm``)
        self._abort = threading.Event()
        self._stuck: list[threading.Thread] = []  # calls abandoned by ``abort``, still blocked
        self.faults = FaultHook()  # does nothing unless a test's fault plan armed it

    # ----- failure handling -----------------------------------------------------------------------
    @ray.method(concurrency_group="control")
    def pid(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="control")
    def abort(self) -> bool:
        """Give up the call in flight (blocked on a lost peer): it returns ``WorldAborted`` at once and
        the world is re-formed by ``reinit``."""
        self._abort.set()
        return True

    @ray.method(concurrency_group="control")
    def arm_faults(self, actions: dict[str, str]) -> bool:
        """Arm this worker's fault hook (``Runtime.inject``: tests and benchmarks only)."""
        self.faults.arm(actions)
        return True

    def _guarded(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on a helper thread, so that ``abort`` can release this worker from a collective
        that will never complete; a gloo collective cannot be interrupted, so the thread is abandoned (it
        fails once ``reinit`` destroys its world) and never touches state the recovery rebuilds."""
        if self._abort.is_set():
            raise WorldAborted("this worker's world was aborted; re-form it (Runtime.recover)")
        out: dict = {}
        done = threading.Event()

        def run() -> None:
            try:
                out["value"] = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
                out["error"] = exc
            finally:
                done.set()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        while not done.wait(0.05):
            if self._abort.is_set():
                self._stuck.append(t)
                raise WorldAborted("a peer was lost; the call in flight was abandoned")
        if "error" in out:
            raise out["error"]
        return out["value"]

    # ----- joining a world ------------------------------------------------------------------------
    def address(self) -> tuple[str, int]:
        from nereus.runtime.cluster.launch import free_port

        return ray.util.get_node_ip_address(), free_port()

    def init_dist(self, master: str, port: int, timeout_s: float) -> str:
        import torch.distributed as dist

        from nereus.runtime.comm.groups import default_backend, local_device

        backend = default_backend()
        if backend == "nccl":
            torch.cuda.set_device(local_device())
        os.environ["LOCAL_RANK"] = "0"
        if master.startswith("store://"):  # several nodes: the head node's store (``nodes.RendezvousStore``)
            from nereus.runtime.hosts.nodes import open_store

            dist.init_process_group(backend, store=open_store(master, timeout_s), rank=self.rank,
                                    world_size=self.world, timeout=timedelta(seconds=timeout_s))
            return backend
        if master.startswith("file://"):  # one host: a file rendezvous, so no TCP store listens on any interface
            init = master
        else:
            os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(port))
            init = "env://"
        dist.init_process_group(backend, init_method=init, rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=timeout_s))
        return backend

    def init_comm(self, timeout_s: float) -> bool:
        from nereus.runtime.comm.transfer import TransferComm

        self.comm = TransferComm(timeout_s)
        return True

    # ----- typed operations on one key's shard (None on workers outside its layout) -------------------
    def _on(self, key: str, fn: Callable[..., T], *args: object) -> T | None:
        """``fn(shard, *args)`` on this worker's shard of ``key`` (guarded), or None without one."""
        sm = self.models.get(key)
        return None if sm is None else self._guarded(fn, sm, *args)

    @staticmethod
    def _output(sm: ShardedModel, out: T) -> ReplicaOutput[T] | None:
        """The result from each replica's output rank, whose result is complete; else None."""
        return ReplicaOutput(sm.groups.coords.dp_rank, out) if sm.is_output_rank else None
