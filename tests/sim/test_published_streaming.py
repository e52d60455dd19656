"""A fully-asynchronous rollouter that pauses its in-flight samples at a sync (verl's partial rollout) never
drains, but it still decodes every token of a version's samples: its production time
(``published_predict.rollout_production``) is at least those tokens at the pace of its full slots, and a
trainer it cannot keep fed waits for the difference (``cost.fully_async.trainer_wait``). A version's local
steps stream its samples, at staleness 0 too: the trainer waits for the last of them while it has done
all but the last step's work, not for the whole rollout after all of it."""

from __future__ import annotations

import pytest

from nereus.cost.fully_async import sample_shortfall
from nereus.cost.hardware import Hardware
from nereus.cost.plan_cost import estimate_plan
from nereus.sim.published_predict import (
    cost_times,
    drain_work,
    predict,
    predicted,
    queue_assembly,
    rollout_production,
    with_controller,
)
from nereus.sim.published_runs import published_run
from tests.helpers import published_rows as rows


def _split(gen_gpus: int) -> dict:
    """verl's 128-GPU 7B fully-async row (staleness 0.5, partial rollout) with ``gen_gpus`` rollout GPUs."""
    row = rows()["verl_fa_6"]
    return {**row, "gen_gpus": str(gen_gpus), "train_gpus": str(int(row["gpus_total"]) - gen_gpus)}


@pytest.mark.parametrize("gen_gpus", [64, 16, 8])
def test_a_version_takes_at_least_its_tokens_at_full_slots(gen_gpus: int) -> None:
    run = published_run(_split(gen_gpus))
    assert run.partial_rollout
    decode = estimate_plan(Hardware(run.job.cluster), run.job, run.plan).costs["actor/generation"].decode
    tokens = decode.sequences * run.job.workload.response.mean  # one replica's share of the version
    floor = tokens * decode.bulk_step_s / decode.batch
    times = cost_times(run)  # the rollout's own seconds, without the driver's pass
    assert rollout_production(run, times) >= floor
    assert times.tail_work_s == pytest.approx(drain_work(decode, run.job.workload.response.mean))
    assert 0 < times.tail_work_s < times.tail_s  # the drain's tokens go faster with every slot busy


def test_a_trainer_the_rollouter_cannot_feed_waits_for_it() -> None:
    fed, starved = published_run(_split(64)), published_run(_split(8))
    for run in (fed, starved):
        times = with_controller(run, cost_times(run))
        work = times.phases["inference"] + times.phases["training"]
        wait = predicted(run, cost_times(run))["t_gen_s"]
        production = rollout_production(run, times)
        short = sample_shortfall(production, work, run.staleness)
        assert wait == pytest.approx(max(queue_assembly(run) + short, production - work))
    assert predicted(fed, cost_times(fed))["t_gen_s"] == pytest.approx(queue_assembly(fed))  # trainer-bound
    assert predicted(starved, cost_times(starved))["t_gen_s"] > 2 * queue_assembly(starved)  # rollout-bound


def test_the_simulator_takes_the_cost_models_drain_scaled_to_its_own_rollout() -> None:
    """The simulator reports no drain of its own (its generation's ``tail_s`` is a tail lever's phase), so a
    streaming row's production on it is the cost model's, scaled as its rollout is: the two sources agree on
    a rollout-bound split (within 20%; 33% apart when the simulator's own tail set its production)."""
    run = published_run(_split(8))
    cost, sim = predict(run, "cost")["t_gen_s"], predict(run, "sim")["t_gen_s"]
    assert sim == pytest.approx(cost, rel=0.2)


def test_at_staleness_0_the_trainer_streams_a_versions_local_steps() -> None:
    """verl's "stream off policy pipeline" (staleness 0, no partial rollout): the step is the rollout plus the
    last local step's work and the assembly, not rollout plus all the work plus the weight sync."""
    run = published_run(rows()["verl_fa_7"])
    assert run.staleness == 0 and not run.partial_rollout
    times = with_controller(run, cost_times(run))
    p, out = times.phases, predicted(run, cost_times(run))
    work, production = p["inference"] + p["training"], rollout_production(run, times)
    assert production > 0.75 * work  # the last local step is the one short of samples
    assert out["t_gen_s"] == pytest.approx(queue_assembly(run) + production - 0.75 * work)
    assert out["t_step_s"] == pytest.approx(out["t_gen_s"] + work)
    assert out["t_step_s"] < production + work  # not taking turns


def test_a_staleness_below_one_local_step_waits_for_the_first_steps_samples() -> None:
    """verl_fa_8 (staleness 0.1, partial rollout): a version starts 0.1 of its samples ahead, its first of
    four local steps needs 0.25, so the trainer waits for 0.15 of the rollouter's production."""
    run = published_run(rows()["verl_fa_8"])
    times = with_controller(run, cost_times(run))
    production = rollout_production(run, times)
    wait = predicted(run, cost_times(run))["t_gen_s"]
    assert wait == pytest.approx(queue_assembly(run) + 0.15 * production)


def test_an_empty_staleness_is_verls_default_threshold() -> None:
    """A fully-async row that leaves ``staleness`` empty runs at verl's default 0.1 (fully_async_ppo_trainer.yaml),
    partial rollout included: priced as the row that says 0.1."""
    stated = rows()["verl_fa_8"]
    assert stated["staleness"] == "0.1"
    empty = published_run({**stated, "staleness": ""})
    assert empty.partial_rollout
    assert predict(empty, "cost") == pytest.approx(predict(published_run(stated), "cost"))
