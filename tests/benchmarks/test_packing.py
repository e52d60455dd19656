"""benchmarks/packing.py without its Ray runtime: the workload drawn from its job, its padding, the two modes'
plans (placed as a run places them), the cost model's prediction of both, and the objective rebuilt from
micro-batch losses."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import packing  # noqa: E402

from nereus.cost.stage_tokens import row_lengths  # noqa: E402
from nereus.planner.layouts import read_plan_file  # noqa: E402
from nereus.runtime.parallel.sharded import ReplicaStats, TrainStats  # noqa: E402

JOB = packing.load_job(packing.JOB)


def test_responses_are_the_jobs_quantiles_shuffled_with_a_long_tail():
    lengths = packing.response_lengths(JOB)
    prompt = JOB.workload.prompt_length
    assert sorted(n + prompt for n in lengths) == sorted(row_lengths(JOB, JOB.sequences_per_step()))
    assert lengths != sorted(lengths) and lengths == packing.response_lengths(JOB)  # shuffled, deterministic
    assert max(lengths) == JOB.workload.response.max and sorted(lengths)[len(lengths) // 2] < 100
    roll = packing.rollout(JOB)
    assert roll.tokens.shape == (32, prompt + max(lengths)) and roll.lengths.tolist() == [prompt + n for n in lengths]
    assert packing.padding_fraction(roll) > 0.75
    assert packing.model_config(JOB).arch == JOB.models["reference"]


def test_modes_differ_only_in_the_token_budget():
    padded, packed = (packing.plan(JOB, mode) for mode in packing.MODES)
    width = JOB.workload.prompt_length + JOB.workload.response.max
    for pad in padded.placements:
        pk = packed.placement(pad.model_stage)
        assert pad.layout.max_token_len == 0 and pad.gpus == pk.gpus == (0, 1)
        if pad.model_stage.stage == "generation":
            assert pk.layout == pad.layout
        else:  # the padded micro-batch's tokens
            assert pk.layout.max_token_len == pad.layout.micro_batch_size * width
            assert (pk.layout.dp, pk.layout.micro_batch_size, pk.layout.recompute) == (2, pad.layout.micro_batch_size,
                                                                                       "none")


def test_prediction_prices_both_modes_per_part_and_the_written_plans_read_back(tmp_path):
    files = packing.write_plans(JOB, tmp_path)
    for mode in packing.MODES:
        assert read_plan_file(files[mode]) == packing.plan(JOB, mode)
        assert json.loads(files[mode].read_text()) == json.loads((packing.PLANS / files[mode].name).read_text())
    padded, packed = (packing.predict(JOB, packing.plan(JOB, mode)) for mode in packing.MODES)
    assert set(padded) == set(packed) == {*packing.PARTS, "total"}
    assert padded["total"] == sum(padded[p] for p in packing.PARTS)
    assert all(0 < packed[p] < padded[p] for p in packing.PARTS)  # 83% of the padded tokens are padding


def test_objective_weights_micro_batches_by_their_rows():
    lay = packing.plan(JOB, "packed").placement(packing.ModelStage("actor", "training")).layout
    lay = packing.replace(lay, max_token_len=20)  # dp 2, 20 tokens per micro-batch
    mb = packing.TrainBatch(torch.zeros(4, 10, dtype=torch.long), lengths=torch.tensor([10, 10, 4, 4]))
    stats = TrainStats((ReplicaStats((1.0,), (), None), ReplicaStats((3.0,), (), None)))
    # dp 2 by tokens: rows {0, 2} and {1, 3}, each one micro-batch of 14 tokens: losses 1 and 3, 2 rows each
    assert packing.objective(stats, mb, lay) == 2.0
