"""Process groups of one layout over a list of global ranks; several layouts' groups coexist.

Every rank of the default (world) group must construct ``ParallelGroups`` with the same arguments, in the
same order as every other rank, even ranks outside ``ranks``: torch.distributed creates each group
collectively, and a rank that skips a creation makes the others hang (until ``timeout``).
The degrees, the rank order inside ``ranks`` (tensor-parallel fastest, then data-parallel, then pipeline),
each rank's coordinates and every group's members come from the layout's ``spec.parallel_dims.ParallelDims``;
``ParallelGroups`` only turns those member lists into process groups and holds them.
"""

from __future__ import annotations

import inspect
import os
from datetime import timedelta
from functools import cache

import torch
import torch.distributed as dist

from nereus.spec.layout import Layout
from nereus.spec.parallel_dims import Coord

DEFAULT_TIMEOUT = timedelta(minutes=10)


def default_backend() -> str:
    """NCCL when CUDA devices are present, gloo on CPU."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def local_device() -> torch.device:
    """This process's device: ``cuda:LOCAL_RANK`` (or the rank modulo the device count) on GPUs, else CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0))
    return torch.device("cuda", index % torch.cuda.device_count())


@cache
def _new_group_keeps_order() -> bool:
    """Whether this torch's ``new_group`` takes ``sort_ranks`` (older releases, such as the 2.11 of
    some CUDA images, always sort a group's members)."""
    return "sort_ranks" in inspect.signature(dist.new_group).parameters


def new_group_in_order(members: list[int], timeout: timedelta) -> dist.ProcessGroup:
    """A process group whose ranks are ``members`` in the given order (a rank's place in the group is its
    layout coordinate). A torch that can only sort members builds groups whose members are already
    sorted, and refuses others in one line rather than shard in the wrong order."""
    if _new_group_keeps_order():
        return dist.new_group(members, timeout=timeout, sort_ranks=False)
    if members != sorted(members):
        raise RuntimeError(f"process group {members}: torch {torch.__version__} sorts a group's ranks, and this "
                           "layout needs them in coordinate order; install torch >= 2.13 (the runtime's pin)")
    return dist.new_group(members, timeout=timeout)


OUTSIDE = Coord(-1, -1, -1)  # the coordinates of a rank outside the layout


class ParallelGroups:
    """TP, DP and PP groups (and, for tied embeddings under PP, first/last-stage groups; under expert
    parallelism, EP and expert-data-parallel groups) of one layout,
    built from its ``dims`` (``ParallelDims.group_members``); ``coords`` is this rank's ``Coord``.

    ``member`` is False on ranks outside ``ranks``; their group attributes are None and ``coords`` is
    ``OUTSIDE``.
    """

    def __init__(self, layout: Layout, ranks: list[int] | None = None, tied_embeddings: bool = False,
                 timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        world = dist.get_world_size()
        self.layout, self.dims = layout, layout.dims
        self.ranks = list(range(self.dims.world)) if ranks is None else list(ranks)
        if len(self.ranks) != self.dims.world or len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"layout {layout.short()} needs {self.dims.world} distinct ranks, got {self.ranks}")
        if max(self.ranks) >= world:
            raise ValueError(f"ranks {self.ranks} exceed the world of {world}")
        me = dist.get_rank()
        self.member = me in self.ranks
        self.rank = self.ranks.index(me) if self.member else -1  # rank inside the layout
        self.coords: Coord = self.dims.coords(self.rank) if self.member else OUTSIDE
        self.device = local_device()
        self.tp_group = self._make("tp", timeout)
        self.dp_group = self._make("dp", timeout)
        self.pp_group = self._make("pp", timeout)
        self.embed_group = self._make("embed", timeout) if tied_embeddings and self.dims.pp > 1 else None
        # expert parallelism: the all-to-all group and the group its experts' gradients are reduced over
        self.ep_group = self._make("ep", timeout) if self.dims.ep > 1 else None
        self.edp_group = self._make("edp", timeout) if self.dims.ep > 1 else None

    def _make(self, kind: str, timeout: timedelta) -> dist.ProcessGroup | None:
        mine = None
        me = dist.get_rank()
        for members in self.dims.group_members(kind, self.ranks):
            # collective over the whole world; unsorted, so a rank's place in the group is its coordinate
            # (TP shards gather in TP order, ZeRO ranges follow the DP coordinate as the contract says)
            group = new_group_in_order(members, timeout)
            if me in members:
                mine = group
        return mine

    def pp_peer(self, stage: int) -> int:
        """Global rank of pipeline stage ``stage`` with this rank's DP and TP coordinates."""
        return self.ranks[self.dims.rank(stage, self.coords.dp_rank, self.coords.tp_rank)]

    @property
    def first_stage(self) -> bool:
        return self.coords.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.coords.pp_rank == self.dims.pp - 1

    def destroy(self) -> None:
        """Release this layout's groups on this rank."""
        for g in (self.tp_group, self.dp_group, self.pp_group, self.embed_group, self.ep_group, self.edp_group):
            if g is not None:
                dist.destroy_process_group(g)
        self.tp_group = self.dp_group = self.pp_group = self.embed_group = self.ep_group = self.edp_group = None
