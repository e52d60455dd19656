"""cost.controller: the driver's part of a single-controller stage call, and how the published-run
mapping (sim.published_predict) adds it to the stage timers that wrap it."""

from __future__ import annotations

import csv
from importlib import resources

import pytest

from nereus.cost.controller import CONTROLLER_S_PER_TOKEN_SLOT, controller_time
from nereus.cost.fully_async import queue_assembly_time, sample_shortfall
from nereus.sim.published_predict import (
    StepTimes,
    cost_times,
    predicted,
    queue_assembly,
    rollout_production,
    with_controller,
)
from nereus.sim.published_runs import published_run


def _row(run_id: str) -> dict:
    text = resources.files("nereus.cost").joinpath("e2e_runs.csv").read_text()
    rows = csv.DictReader(line for line in text.splitlines() if not line.startswith("#"))
    return next(r for r in rows if r["run_id"] == run_id)


def test_controller_time_grows_with_padded_slots_not_gpus() -> None:
    assert controller_time(8192, 30720) == pytest.approx(8192 * 30720 * CONTROLLER_S_PER_TOKEN_SLOT)
    assert controller_time(2 * 8192, 30720) == pytest.approx(2 * controller_time(8192, 30720))
    assert controller_time(0, 30720) == 0.0


def test_each_running_stage_call_pays_the_driver_once() -> None:
    run = published_run(_row("verl_oso_3"))  # colocated, sync: generation, old log-probs, update
    assert run.padded_tokens == 2048 + 8192  # max prompt + max response: verl pads to the caps
    device = cost_times(run)
    moved = controller_time(run.job.sequences_per_step(), run.padded_tokens)
    times = with_controller(run, device)
    for name, seconds in device.stages.items():
        assert times.stages[name] == pytest.approx(seconds + moved if seconds > 0 else 0.0)
    assert sum(times.phases.values()) == pytest.approx(sum(device.phases.values()) + 3 * moved)
    out = predicted(run, device)
    assert out["t_old_logprob_s"] == pytest.approx(device.stages["actor/inference"] + moved)
    assert out["t_step_s"] == pytest.approx(sum(times.phases.values()))


def test_one_step_off_generation_column_is_the_workers_own_timer() -> None:
    run = published_run(_row("verl_oso_4"))  # its t_gen_s is generate_sequences inside the rollout worker
    device = cost_times(run)
    assert predicted(run, device)["t_gen_s"] == pytest.approx(device.stages["actor/generation"])
    none = StepTimes({k: 0.0 for k in device.stages}, {k: 0.0 for k in device.phases})
    assert with_controller(run, none) == none  # a stage that does not run moves nothing


def test_published_rows_update_in_verl_recipe_mini_batches() -> None:
    run = published_run(_row("verl_fa_3"))  # 512 prompts, 32 a mini-batch in verl's DAPO recipes
    assert run.job.algorithm.mini_batches == 16


def test_fully_async_gen_timer_is_the_wait_or_the_batch_assembly() -> None:
    run = published_run(_row("verl_fa_4"))  # 32:32, staleness 0.5: the rollout keeps ahead of the trainer
    assembly = queue_assembly(run)
    assert assembly == pytest.approx(queue_assembly_time(8192, 2048 + 28672))
    assert assembly == pytest.approx(controller_time(8192, 2048 + 28672) / 2)  # one direction of a call
    device = cost_times(run)
    p = with_controller(run, device).phases
    out = predicted(run, device)
    work, production = p["inference"] + p["training"], rollout_production(run, with_controller(run, device))
    assert out["t_gen_s"] == pytest.approx(max(assembly + sample_shortfall(production, work, 0.5),
                                               production - work))
    assert out["t_gen_s"] > 0
    assert out["t_step_s"] == pytest.approx(out["t_gen_s"] + work)  # the sync is outside the step timer
    assert queue_assembly(published_run(_row("verl_fa_7"))) == pytest.approx(assembly)  # streams at staleness 0
    assert queue_assembly(published_run(_row("verl_oso_3"))) == 0.0
