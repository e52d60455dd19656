"""The simulator's verl baselines against verl's own published steps: before a speedup against
``verl-like`` (or ``verl-async-like``) is claimed, the baseline, choosing its own layouts for a published
run's job as it does in every simulated comparison, should take the step time verl published.

A verl row in sync mode with every model colocated is ``verl-like``'s case (verl's hybrid engine); a
one-step-off row is ``verl-async-like``'s (the rollout on a pool of its own; the baseline splits the GPUs
in half, the row's own split may differ). The step is the simulator's truth with its structural terms
(``sim.reality``) at the row's padded width, the mean over ``published_predict.SIM_SEEDS`` clusters, with
the row's layouts replaced by the baseline's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nereus.control.backend import RunToEnd
from nereus.sim.backend import SimBackend
from nereus.sim.baselines import make_policy
from nereus.sim.published_frameworks import VERL, named_framework
from nereus.sim.published_predict import SIM_SEEDS, SIM_STEPS, one_point, truth_of
from nereus.sim.published_runs import PublishedRun

BASELINE_OF = {"sync": "verl-like", "one_step_off": "verl-async-like"}


@dataclass(frozen=True)
class BaselineStep:
    run_id: str
    baseline: str
    published_s: float
    simulated_s: float

    @property
    def error_pct(self) -> float:
        return 100 * (self.simulated_s / self.published_s - 1)


def baseline_of(run: PublishedRun, framework: str) -> str | None:
    """The baseline standing for the row's system, None when none does (another framework or mode, a
    synchronous row whose rollout has GPUs of its own, no published step or a published 0)."""
    if named_framework(framework) is not VERL or run.published.get("t_step_s", 0) <= 0:
        return None
    if run.sync_mode == "sync" and run.plan.strategy != "colocated":
        return None
    return BASELINE_OF.get(run.sync_mode)


def baseline_step(run: PublishedRun, baseline: str, seeds: int = SIM_SEEDS, steps: int = SIM_STEPS) -> BaselineStep:
    """The baseline's own plan for the row's job, run on the truth: its mean step time."""
    trace, truth = one_point(run, steps), truth_of(run)
    policy = make_policy(baseline, run.job)
    plan = policy.initial_plan(run.job.cluster.num_gpus)
    times = [SimBackend(run.job, trace, seed, truth).run_step(plan, step, RunToEnd()).step_time_s
             for seed in range(seeds) for step in range(steps)]
    return BaselineStep(run.run_id, baseline, run.published["t_step_s"], float(np.mean(times)))
