"""On every trace in traces/, the adaptive controller is never worse than the fixed-oracle
baseline (the same initial plan, then DP scaling only) by more than 1% mean step latency: it must not pay
for moves made before calibration knows the hardware (docs/simulator.md, admission rule). Checked for
``nereus`` (between and inside steps, with the tail levers, at run.policy_lag 0 and 1), ``nereus-tail``
(tail layouts only) and ``nereus-interstep`` (the between-step controller alone).

The runs are short (the first calibration fits and the first re-plans happen in them; growth_from_16's
first GPU change, at step 50, too); benchmarks/paper.py runs the full traces."""

from __future__ import annotations

import pytest

from nereus.sim.run import simulate
from nereus.sim.workload import GrowingBatchJob
from nereus.spec import load_job
from nereus.spec.trace import load_trace
from tests.conftest import EXAMPLES, ROOT

pytestmark = [pytest.mark.slow, pytest.mark.rayless]  # no Ray: may run beside the Ray tests
TRACES = sorted(p.stem for p in (ROOT / "traces").glob("*.yaml"))
STEPS = 40
TOLERANCE = 0.01


def mean_step(job, trace, policy: str, steps: int, policy_lag: int | None = None) -> float:
    first = trace.gpus_at(0, job.cluster.num_gpus)
    biggest = max([first, *(n for _, n in trace.gpus)])
    record = simulate(job.with_gpus(biggest), trace, policy, seed=0, steps=steps, initial_gpus=first,
                      policy_lag=policy_lag)
    return record.summary()["mean_step_s"]


def assert_never_worse(job, name: str, steps: int,
                       policies=(("nereus", 0), ("nereus", 1), ("nereus-tail", 0), ("nereus-interstep", 0))) -> None:
    trace = load_trace(ROOT / "traces" / f"{name}.yaml")
    oracle = mean_step(job, trace, "fixed-oracle", steps)
    for policy, lag in policies:  # with the levers at lag 0 and 1, tail layouts only, between steps alone
        ours = mean_step(job, trace, policy, steps, lag)
        assert ours <= oracle * (1 + TOLERANCE), (f"{name}: {policy} (policy lag {lag}) {ours:.2f} s vs fixed-oracle "
                                                  f"{oracle:.2f} s")


def test_every_repo_trace_is_covered():
    assert len(TRACES) >= 7 and "growth_from_16" in TRACES


@pytest.mark.parametrize("name", TRACES)
def test_nereus_is_never_worse_than_the_fixed_oracle(name):
    assert_never_worse(load_job(EXAMPLES / "ppo_8b_h100.yaml"), name, STEPS)


def test_never_worse_when_the_batch_grows_with_the_gpus():
    job = load_job(EXAMPLES / "ppo_8b_h100.yaml")
    assert_never_worse(GrowingBatchJob.of(job, 16), "growth_from_16", 60)  # 16 -> 64 GPUs at step 50
