"""Process groups keep their members in layout-coordinate order; on a torch whose ``new_group`` can only sort
(no ``sort_ranks``, as in 2.11), groups whose members are already sorted are built and others are refused
in one line naming the fix, before any rank shards in the wrong order."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from nereus.runtime.cluster.launch import run_world
from nereus.runtime.comm import groups as groups_module
from nereus.runtime.comm.groups import ParallelGroups, new_group_in_order
from nereus.spec.layout import Layout

pytestmark = [pytest.mark.rayless, pytest.mark.distributed]

TIMEOUT = timedelta(seconds=30)


def _sorting_torch_body(rank: int, world: int) -> None:
    groups_module._new_group_keeps_order = lambda: False  # this forked rank's torch "cannot" keep order
    tp = ParallelGroups(Layout(tp=2, recompute="none", sequence_parallel=False), [0, 1])
    assert dist.get_rank(tp.tp_group) == rank  # coordinate order equals the sorted order here
    dist.barrier(tp.tp_group)
    tp.destroy()
    with pytest.raises(RuntimeError, match=r"process group \[1, 0\].*torch >= 2\.13"):
        new_group_in_order([1, 0], TIMEOUT)


def _ordered_body(rank: int, world: int) -> None:
    group = new_group_in_order([1, 0], TIMEOUT)  # this torch keeps the order: rank 1 is the group's first
    assert dist.get_rank(group) == 1 - rank
    dist.barrier(group)  # both ranks finished connecting before either closes the group's pairs
    dist.destroy_process_group(group)


def test_a_torch_that_sorts_builds_sorted_groups_and_refuses_the_others():
    run_world(_sorting_torch_body, 2, timeout_s=30, backend="gloo")


def test_groups_keep_the_order_they_are_given():
    run_world(_ordered_body, 2, timeout_s=30, backend="gloo")
