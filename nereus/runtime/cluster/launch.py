"""Start a local torch.distributed world in forked processes (tests, benchmarks, single-machine runs).

Ray actors (``nereus.runtime.cluster.workers``) are the runtime's workers; this launcher serves code that only
needs processes and collectives. It picks NCCL and one CUDA device per rank when CUDA is present.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nereus.runtime.comm.groups import default_backend


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world: int, port: int, timeout_s: float, args: tuple,
           backend: str | None = None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    try:
        fn(rank, world, *args)
        # no rank closes its sockets while a peer still handshakes on them (gloo's connectFullMesh reads
        # "closed by peer" otherwise); a rank that raised skips it and join() ends the others
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_world(fn: Callable, world: int, *args: object, timeout_s: float = 120.0, backend: str | None = None) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` forked ranks with an initialised default group; an
    exception on any rank raises here (and ends the others). ``backend`` forces one (``"gloo"`` keeps a
    CPU-only world on a CUDA machine); by default NCCL with CUDA, else gloo."""
    method = "spawn" if torch.cuda.is_available() else "fork"  # CUDA cannot be used in forked children
    mp.start_processes(_entry, args=(fn, world, free_port(), timeout_s, args, backend), nprocs=world,
                       start_method=method, join=True)
