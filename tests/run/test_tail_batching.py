"""Tail batching (``run.rollout.tail_batching``): the round plan (pure), the engine keeping the first
whole groups and aborting the rest, and a GRPO job alternating short and long rounds with policy lag 0."""

from __future__ import annotations

import json

import pytest

from nereus.rl.data import Prompt
from nereus.run.tail import TailRounds
from nereus.runtime.cluster.launch import run_world
from nereus.runtime.engines.native.decode_engine import DecodeEngine, first_groups
from nereus.runtime.engines.sampling import SamplingParams
from nereus.spec.levers import TailBatching
from tests.run.jobs import tiny_job
from tests.runtime.decode_helpers import alone, layout, prompts, shard


def _prompt(i: int) -> Prompt:
    return Prompt((i, i + 1), str(i), "test", i)


def test_rounds_over_launch_defer_and_replay_from_scratch():
    tail = TailRounds(TailBatching(over_launch=1.5))
    fresh = [_prompt(i) for i in range(4)]
    spare = lambda n: [_prompt(100 + i) for i in range(n)]  # noqa: E731
    short = tail.plan(fresh, spare, dp=2)
    assert not short.long and len(short.launched) == 6 and short.keep_per_replica == 2
    tail.settle(short.launched, [True, False, True, True, False, True])
    assert tail.deferred == [short.launched[1], short.launched[4]]
    short2 = tail.plan([_prompt(10 + i) for i in range(4)], spare, dp=2)
    tail.settle(short2.launched, [False, True, True, False, True, True])
    long = tail.plan([_prompt(20 + i) for i in range(4)], spare, dp=2)
    assert long.long and long.keep_per_replica == 0 and long.launched == [short.launched[1], short.launched[4],
                                                                          short2.launched[0], short2.launched[3]]
    assert tail.deferred == []
    with pytest.raises(ValueError, match="dp=3"):
        tail.plan(fresh, spare, dp=3)
    # the lever turned off with two prompts deferred: one long round of them, topped up with spare draws
    left = TailRounds(TailBatching(over_launch=1.5), [short.launched[1], short.launched[4]], draining=True)
    last = left.plan([_prompt(30 + i) for i in range(4)], spare, dp=2)
    assert last.long and last.launched == [short.launched[1], short.launched[4], *spare(2)] and not left.deferred


def _first(rank: int, world: int) -> None:
    _, sm = shard(layout())
    ps = [p for p in prompts(4) for _ in range(2)]  # 4 groups of 2
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, seed=4, eos_token_id=5)
    want = alone(sm, ps, sp)
    engine = DecodeEngine(sm, sp, slots=8)
    for i, p in enumerate(ps):
        engine.submit(i, p)
    kept, aborted = first_groups(engine, 2, 2)
    assert len(kept) == 4 and {i // 2 for i in kept} and all(i ^ 1 in kept for i in kept)  # whole groups
    assert engine.idle and all(not s.done for s in aborted.values())  # every unfinished sequence aborted
    by_len = sorted(range(4), key=lambda g: (max(len(want[2 * g][0]), len(want[2 * g + 1][0])), g))
    assert {i // 2 for i in kept} == set(by_len[:2])  # the groups whose longest member is shortest
    for i in kept:  # kept answers are the engine's plain answers
        assert engine.finished[i].tokens == want[i][0]


@pytest.mark.slow
def test_engine_keeps_the_first_whole_groups_and_aborts_the_rest():
    run_world(_first, 1, timeout_s=120)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("slots", [0, 8])  # the fixed batch; the continuous-batching engine
def test_grpo_job_alternates_short_and_long_rounds(ray_runtime, tmp_path, slots, monkeypatch):
    from nereus.run.backend import RuntimeBackend
    from nereus.run.job import RLJob

    job = tiny_job("grpo", str(tmp_path), steps=4,
                   rollout={"slots": slots, "tail_batching": {"over_launch": 2.0}})
    seen, real = [], RuntimeBackend.run_step

    def run_step(self, plan, step, policy):  # what the controller is told of each step
        seen.append(real(self, plan, step, policy))
        return seen[-1]

    monkeypatch.setattr(RuntimeBackend, "run_step", run_step)
    rl = RLJob(job, runtime=ray_runtime, out_dir=tmp_path, quiet=True)
    try:
        rl.execute()
    finally:
        rl.release()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["tail/long_round"] for r in rows] == [0.0, 1.0, 0.0, 1.0]
    assert [r["tail/launched_groups"] for r in rows] == [4.0, 2.0, 4.0, 2.0]
    assert all(r["tail/kept_groups"] == 2.0 and r["rollout/policy_lag_max"] == 0.0 for r in rows)
    assert [r["tail/deferred_groups"] for r in rows] == [2.0, 0.0, 2.0, 0.0]
    for m, r in zip(seen, rows, strict=True):  # every trained response's length reaches the controller
        assert len(m.response_lengths) == r["tail/kept_groups"] * job.algorithm.samples_per_prompt
        assert sum(m.response_lengths) / len(m.response_lengths) == pytest.approx(r["response_length/mean"])
    for r in rows:  # each round's kept groups by how many siblings solved them (shares of 2 groups)
        shares = [r[f"batch/solve_{k}"] for k in ("none", "all", "partial")]
        assert sum(shares) == pytest.approx(1.0) and all(2 * s == round(2 * s) for s in shares)


def test_partial_rounds_carry_groups_per_replica_and_stitch_versions():
    from nereus.run.partial import PartialRollouts, resumed_inputs, stitch
    from nereus.runtime.engines.native.decode_engine import Carried

    part = PartialRollouts(2.0)
    fresh = [_prompt(i) for i in range(2)]
    spare = lambda n: [_prompt(100 + i) for i in range(n)]  # noqa: E731
    rnd = part.plan(fresh, spare, dp=2)  # 4 groups of 1 row: replica 0 holds groups 0, 1; replica 1 groups 2, 3
    assert len(rnd.launched) == 4 and rnd.keep_per_replica == 1 and rnd.must_per_replica == 0
    answers = [([1], [-0.1]), Carried([7, 8], [-0.2, -0.3], False), Carried([9], [-0.4], True), ([2], [-0.5])]
    part.settle(rnd, answers, 1, 2, step=0)
    assert [[g.prompt for g in c] for c in part.carried] == [[rnd.launched[1]], [rnd.launched[2]]]
    nxt = part.plan([_prompt(10), _prompt(11)], spare, dp=2)
    assert nxt.must_per_replica == 1 and nxt.launched[0] == rnd.launched[1] and nxt.launched[2] == rnd.launched[2]
    ids, counts, done = resumed_inputs(nxt, [list(p.ids) for p in nxt.launched], 1)
    assert ids[0] == list(rnd.launched[1].ids) + [7, 8] and counts == (2, 0, 1, 0) and done == frozenset({2})
    tokens, logps, versions = stitch(nxt, ([5], [-0.6]), 0, 1, step=1)
    assert tokens == [7, 8, 5] and logps == [-0.2, -0.3, -0.6] and versions == [0, 0, 1]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("slots", [0, 8])
def test_grpo_job_with_partial_rollout_records_policy_lag(ray_runtime, tmp_path, slots):
    from nereus.run.job import RLJob

    job = tiny_job("grpo", str(tmp_path), steps=3, policy_lag=1,
                   rollout={"slots": slots, "partial_rollout": {"over_launch": 2.0}})
    rl = RLJob(job, runtime=ray_runtime, out_dir=tmp_path, quiet=True)
    try:
        rl.execute()
    finally:
        rl.release()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["partial/launched_groups"] == 4.0 and r["partial/kept_groups"] == 2.0 for r in rows)
    assert all(r["partial/carried_groups"] == 2.0 for r in rows)
    assert rows[0]["rollout/policy_lag_max"] == 0.0  # nothing carried into the first step
    assert all(0.0 <= r["rollout/policy_lag_mean"] <= r["rollout/policy_lag_max"] <= 1.0 for r in rows)
    assert any(r["partial/resumed_tokens"] > 0 for r in rows[1:])
