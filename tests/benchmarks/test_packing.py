"""benchmarks/packing.py without its Ray runtime: the long-tail workload, its padding, the two modes' layouts
(packed ones by ``run.setup.packed``, as a run gets them), and the objective rebuilt from micro-batch losses."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import packing  # noqa: E402

from nereus.runtime.parallel.sharded import ReplicaStats, TrainStats  # noqa: E402


def test_workload_has_a_long_tail_and_mostly_padding():
    w = packing.Workload(rows=32, prompt=32, max_response=1024)
    lengths = packing.long_tail_lengths(w)
    assert max(lengths) == 1024 and sorted(lengths)[len(lengths) // 2] < 100
    roll = packing.rollout(w)
    assert roll.tokens.shape == (32, 32 + 1024) and roll.lengths.tolist() == [32 + n for n in lengths]
    assert packing.padding_fraction(roll) > 0.7


def test_modes_differ_only_in_the_token_budget():
    padded, packed = packing.layouts(False, 100), packing.layouts(True, 100)
    for key, lay in padded.items():
        assert lay.max_token_len == 0
        assert packed[key].max_token_len == lay.micro_batch_size * 100  # the padded micro-batch's tokens
        assert (packed[key].dp, packed[key].micro_batch_size) == (lay.dp, lay.micro_batch_size)


def test_objective_weights_micro_batches_by_their_rows():
    lay = packing.layouts(True, 10)["actor", "training"]  # dp 2, 20 tokens per micro-batch
    mb = packing.TrainBatch(torch.zeros(4, 10, dtype=torch.long), lengths=torch.tensor([10, 10, 4, 4]))
    stats = TrainStats((ReplicaStats((1.0,), (), None), ReplicaStats((3.0,), (), None)))
    # dp 2 by tokens: rows {0, 2} and {1, 3}, each one micro-batch of 14 tokens: losses 1 and 3, 2 rows each
    assert packing.objective(stats, mb, lay) == 2.0
