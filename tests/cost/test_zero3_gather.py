"""DeepSpeed-Chat's Hybrid Engine sync (``cost.weight_sync.zero3_gather_time``): the ZeRO-3 partitions
are gathered at every ``generate`` call, and DeepSpeed-Chat calls it once per generation micro-batch."""

from __future__ import annotations

import csv
from dataclasses import replace
from importlib import resources

from nereus.cost.hardware import Hardware
from nereus.cost.memory import BF16
from nereus.cost.weight_sync import generate_calls, zero3_gather_time
from nereus.sim.published_runs import published_run
from nereus.spec.layout import ModelStage


def _dschat_70b():
    text = resources.files("nereus.cost").joinpath("e2e_runs.csv").read_text()
    rows = csv.DictReader(line for line in text.splitlines() if not line.startswith("#"))
    return published_run(next(r for r in rows if r["run_id"] == "dschat_70B"))


def test_a_replica_calls_generate_once_per_micro_batch_of_its_share() -> None:
    run = _dschat_70b()
    gen = run.plan.placement(ModelStage("actor", "generation")).layout
    per_call = run.job.options.rollout_call_sequences
    share = -(-run.job.sequences_per_step() // gen.dp)
    assert per_call > 0 and share > per_call  # the row's framework hands its share in several calls
    assert generate_calls(run.job, gen) == -(-share // per_call)
    whole = replace(run.job, options=replace(run.job.options, rollout_call_sequences=0))
    assert generate_calls(whole, gen) == 1


def test_every_generate_call_gathers_the_whole_model_over_its_shards() -> None:
    run = _dschat_70b()
    hw = Hardware(run.job.cluster)
    train = run.plan.placement(ModelStage("actor", "training"))
    gen = run.plan.placement(ModelStage("actor", "generation"))
    shards = train.layout.tp * train.layout.pp * train.layout.dp  # ZeRO-3: every training rank holds a shard
    one_gather = hw.all_gather_time(run.job.models["actor"].params() * BF16, shards)
    calls = generate_calls(run.job, gen.layout)
    assert calls > 1
    assert zero3_gather_time(hw, run.job, train, gen) == calls * one_gather
