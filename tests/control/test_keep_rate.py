"""The controller prices the generation batches dynamic sampling drew (DAPO, arXiv:2503.14476): the
measured step's job for calibration, the recent steps' mean for the forecast (control.controller)."""

from dataclasses import replace

import pytest

from nereus.control.backend import StepMetrics
from nereus.control.controller import Controller, observed_job
from tests.sim.test_dynamic_sampling import _grpo


def test_the_controller_prices_the_batches_it_measured():
    job = _grpo()
    m = StepMetrics(0, {}, {}, 1.0, 500.0, 4000.0, 256, 1e5, detail={"train/num_gen_batches": 4.0})
    assert observed_job(job, m, 0.6).workload.filter_keep_rate == 0.25
    assert observed_job(job, replace(m, detail={}), 0.6).workload.filter_keep_rate == 1.0
    ctrl = Controller(job)
    ctrl.initial_plan(8)
    assert ctrl.job_for(1, 8).workload.filter_keep_rate == 1.0  # the prior until a step is measured
    for step, batches in enumerate((2.0, 4.0)):
        ctrl.observe(replace(m, step=step, detail={"train/num_gen_batches": batches}))
    assert ctrl.job_for(2, 8).workload.filter_keep_rate == pytest.approx(1 / 3)
