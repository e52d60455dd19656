"""The verl baselines on verl's published rows (``sim.published_baseline``)."""

from __future__ import annotations

import math

from nereus.sim.published_baseline import baseline_of, baseline_step
from nereus.sim.published_runs import published_run
from tests.helpers import published_rows as _rows


def test_each_verl_mode_has_its_baseline() -> None:
    rows = _rows()
    assert baseline_of(published_run(rows["verl_oso_1"]), "verl") == "verl-like"  # colocated, sync
    assert baseline_of(published_run(rows["verl_oso_2"]), "verl") == "verl-async-like"  # one-step-off
    assert baseline_of(published_run(rows["verl_fa_2"]), "verl") is None  # fully async: no baseline of it
    assert baseline_of(published_run(rows["verl_oso_1"]), "OpenRLHF") is None
    assert baseline_of(published_run(rows["verl_wsync_1"]), "verl") is None  # no published step


def test_the_baseline_chooses_its_own_layouts_for_the_rows_job() -> None:
    run = published_run(_rows()["verl_fa_5"])
    step = baseline_step(run, "verl-like", seeds=1, steps=1)
    assert step.published_s == run.published["t_step_s"] and math.isfinite(step.simulated_s)
    assert step.simulated_s > 0 and step.error_pct == 100 * (step.simulated_s / step.published_s - 1)
