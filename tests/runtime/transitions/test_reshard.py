"""The reshard baselines on a forked gloo world of 4 ranks: old pieces with replicas, a ZeRO-like uneven split
and partial overlaps move to a column split with replicated, several-per-rank and missing pieces; both the
gather-scatter and the DCP checkpoint-restart baseline must return bit-identical slices of the tensors."""

from __future__ import annotations

import math

import pytest
import torch

from nereus.runtime.cluster.launch import run_world
from nereus.runtime.transitions.reshard import (
    Box,
    Shards,
    _owners,
    all_pairs_bandwidth,
    checkpoint_reshard,
    gather_scatter,
    p2p_bandwidth,
)

pytestmark = [pytest.mark.distributed, pytest.mark.rayless]  # no Ray: may run beside the Ray tests
WORLD = 4
SHAPES = {"w1": (8, 6), "w2": (6, 10), "wb": (8, 4), "v": (12,)}
DTYPES = {"w1": torch.float32, "w2": torch.float32, "wb": torch.bfloat16, "v": torch.float32}


def _tensors() -> dict[str, torch.Tensor]:
    # every rank rebuilds the same globals from the seed, so the ranks need no reference data shipped in
    gen = torch.Generator().manual_seed(1234)
    return {n: torch.randn(SHAPES[n], generator=gen).to(DTYPES[n]) for n in sorted(SHAPES)}


def _old_boxes(rank: int) -> dict[str, list[Box]]:
    half = rank % 2  # row block r % 2: ranks 0/2 and 1/3 are replicas of each other
    boxes: dict[str, list[Box]] = {
        n: [((4 * half, 4 * half + 4), (0, SHAPES[n][1]))] for n in ("w1", "wb")
    }
    boxes["w2"] = [((3 * half, 3 * half + 3), (0, 10))]
    # ZeRO-like uneven split of the flat tensor, two pieces on rank 0, plus a partially overlapping extra
    boxes["v"] = {0: [((0, 2),), ((2, 3),)], 1: [((3, 7),), ((5, 9),)], 2: [((7, 8),)], 3: [((8, 12),)]}[rank]
    if rank == 3:
        boxes["w1"].append(((2, 7), (1, 5)))  # straddles both row blocks
    return boxes


def _new_boxes(rank: int) -> dict[str, list[Box]]:
    w1_cols = [(0, 2), (2, 3), (3, 5), (5, 6)]
    w2_cols = {0: [(0, 3), (3, 4)], 1: [(4, 8)], 2: [(8, 10)], 3: []}  # rank 3 holds none of w2
    return {
        "w1": [((0, 8), w1_cols[rank])],
        "w2": [((0, 6), c) for c in w2_cols[rank]],
        "wb": [((0, 8), (0, 2) if rank < 2 else (2, 4))],  # replicated on load
        "v": {0: [((0, 12),)], 1: [((0, 5),), ((9, 12),)], 2: [], 3: [((4, 10),)]}[rank],
    }


def _slice(t: torch.Tensor, box: Box) -> torch.Tensor:
    return t[tuple(slice(s, e) for s, e in box)]


def _check(got: Shards, want: dict[str, list[Box]], full: dict[str, torch.Tensor]) -> None:
    assert {n for n, bs in want.items() if bs} <= set(got)
    for name, boxes in want.items():
        pieces = got.get(name, [])
        assert [b for b, _ in pieces] == boxes
        for box, t in pieces:
            assert t.dtype == DTYPES[name]
            assert torch.equal(t, _slice(full[name], box)), (name, box)


def test_owners_tile_each_tensor_once():
    # replicas and partial overlaps are cut so the sent/saved pieces tile each tensor exactly once
    owned = _owners([_old_boxes(r) for r in range(WORLD)])
    for name, pieces in owned.items():
        cover = torch.zeros(SHAPES[name], dtype=torch.int32)
        for holder, i, box in pieces:
            held = _old_boxes(holder)[name][i]
            assert all(hs <= s and e <= he for (s, e), (hs, he) in zip(box, held, strict=True))
            _slice(cover, box).add_(1)
        assert torch.equal(cover, torch.ones_like(cover)), name


def _reshard_rank(rank: int, world: int, path: str) -> None:
    full = _tensors()
    old = {n: [(b, _slice(full[n], b).clone()) for b in bs] for n, bs in _old_boxes(rank).items()}
    new = _new_boxes(rank)
    _check(gather_scatter(old, new, SHAPES, DTYPES, root=1), new, full)
    _check(checkpoint_reshard(old, new, SHAPES, DTYPES, path), new, full)


def test_baselines_bit_identical(tmp_path):
    run_world(_reshard_rank, WORLD, str(tmp_path / "ckpt"), timeout_s=60.0)


def _bandwidth_rank(rank: int, world: int) -> None:
    for rate in (p2p_bandwidth(1 << 16, repeats=2), all_pairs_bandwidth(1 << 16, repeats=2)):
        assert math.isfinite(rate) and rate > 0


def test_bandwidth_positive():
    run_world(_bandwidth_rank, WORLD, timeout_s=60.0)
