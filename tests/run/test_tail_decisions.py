"""The plan's tail levers on the runtime (``run.tail_decisions``, ``run.rollout.levers: auto``): the start decision of
a one-call generation, the lever log, the controller's choice on a held plan once calibrated (steps run
with levers left out of the calibration), and jobs whose plan carries speculation or tail batching.
No timing is asserted: the runtime tests use fixed lever rules, the choice is made on given step times."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from nereus.control.backend import StepMetrics
from nereus.control.held import HeldPlan
from nereus.control.intrastep import NoTail, PhasedPolicy
from nereus.control.tail_policy import FixedSpeculation, FixedTailBatching
from nereus.cost.hardware import Hardware
from nereus.cost.plan_cost import estimate_plan
from nereus.run.adaptive import policy_for
from nereus.run.tail_decisions import LeverLog, ask_at_start, change_line
from nereus.runtime.engines.answers import DecodeStats
from nereus.runtime.engines.sampling import SamplingParams
from nereus.spec.errors import SpecError
from nereus.spec.generation import Continue, GenerationEntry, SetSpeculation
from nereus.spec.levers import GenerationLevers, Speculation, TailBatching
from tests.run.jobs import tiny_job

SPEC = Speculation("suffix", 3, 64)


class Answer:
    def __init__(self, decision) -> None:
        self.decision = decision

    def during_generation(self, status):
        assert status.point == "start" and status.levers is not None
        return self.decision


def test_the_start_decision_sets_speculation_and_records_the_call_s_counters():
    prompts, params = [[1, 2]] * 4, SamplingParams(max_new_tokens=5)
    levers = GenerationLevers(speculation=SPEC)
    start = ask_at_start(Answer(SetSpeculation(speculation=SPEC, gain_s=0.1)), 3, prompts, params, 2, levers)
    assert start.params.speculation == SPEC  # the policy's decision is what the engine carries out
    [entry] = start.entries(DecodeStats(9, 4, 10, 30, 12))
    assert entry.step == 3 and entry.outcome.applied
    assert entry.outcome.figures == {"verifications": 10.0, "draft_tokens": 30.0, "accepted_tokens": 12.0}
    assert GenerationEntry.from_json(json.loads(json.dumps(entry.to_json()))) == entry
    model = replace(SPEC, draft="draft_model")  # no draft model in the runtime's engines: recorded, not done
    refused = ask_at_start(Answer(SetSpeculation(speculation=model)), 0, prompts, params, 2, levers)
    assert refused.params == params and not refused.entries(DecodeStats())[0].outcome.applied
    assert ask_at_start(Answer(Continue()), 0, prompts, params, 2, levers).entries(DecodeStats()) == ()


def test_the_lever_log_says_each_change_once_and_sums_up_each_setting():
    log = LeverLog()
    on = GenerationLevers(speculation=SPEC, predicted={"base_s": 0.3, "step_s": 0.25, "tail_batching_s": 0.27,
                                                       "speculation_s": 0.25})
    assert log.step_done(0, None, 0.31, None) == ({"nereus/levers/on": 0.0, "nereus/levers/predicted_gain_s": 0.0,
                                                   "nereus/levers/measured_gain_s": 0.0}, None)
    _, line = log.step_done(1, None, 0.30, on)
    assert line == change_line(2, on) and "speculation (suffix drafts, k=3" in line and "tail_batching 0.270 s" in line
    metrics, line = log.step_done(2, on, 0.26, replace(on, predicted={"base_s": 0.31, "step_s": 0.24}))
    assert line is None and metrics["nereus/levers/on"] == 1.0  # the same levers re-priced: nothing to say
    assert metrics["nereus/levers/measured_gain_s"] == pytest.approx(0.045)  # against the plain steps' median
    log.step_done(3, on, 0.24, None, same_plan=False)
    [span] = log.spans
    assert span.measured_s == [0.26, 0.24] and span.predicted_gain_s == pytest.approx(0.05)
    assert span.measured_gain_s == pytest.approx(0.055) and "steps 3-4" in log.summary()[0]
    assert "measured 0.250 s against 0.305 s, the median plain step before it (gain +0.055 s)" in log.summary()[0]
    log.step_done(4, None, 0.2, on)  # on other placements: no plain step measured there yet
    log.step_done(5, on, 0.25, on)
    assert log.spans[-1].plain_s is not None  # step 4 ran plain on the new placements
    fresh = LeverLog()
    fresh.step_done(0, on, 0.25, on)
    assert fresh.spans[0].reference_s == 0.3 and "the calibrated plain step" in fresh.summary()[0]


def _levers_job(tmp_path, **rollout):
    return tiny_job("grpo", str(tmp_path), steps=8, rollout={"levers": "auto", **rollout})


def test_auto_levers_are_refused_beside_fixed_ones_and_vllm(tmp_path):
    with pytest.raises(SpecError, match=r"run\.rollout\.levers.*speculative"):
        _levers_job(tmp_path, speculative={"num_speculative_tokens": 2})
    with pytest.raises(SpecError, match=r"run\.rollout\.levers.*tail_batching"):
        _levers_job(tmp_path, tail_batching={})
    with pytest.raises(SpecError, match=r"run\.rollout\.levers.*native"):
        _levers_job(tmp_path, engine="vllm", cpu_kv_cache_gib=0.0625)
    with pytest.raises(SpecError, match=r"run\.rollout\.levers"):
        _levers_job(tmp_path, levers="always")


def measured(job, plan, step: int, scale: float, levers: GenerationLevers | None = None) -> StepMetrics:
    """A measured step of ``plan``: the cost model's stage times for the job times ``scale`` (given numbers,
    no clock; a calibration fits them exactly)."""
    est = estimate_plan(Hardware(job.cluster), job, plan)
    stages = {ms: scale * t for ms, t in est.stage_times.items()}
    phases = {k: scale * t for k, t in est.phase_times.items()}
    return StepMetrics(step, stages, phases, sum(phases.values()), job.workload.response.mean,
                       job.workload.response.max, job.sequences_per_step(), 1.0, gpus=plan.num_gpus, levers=levers,
                       sibling_correlation=0.9 if levers is None else 0.1, length_sigma=0.8 if levers is None else 2.0)


def test_a_held_plan_chooses_levers_after_its_first_fit_and_calibrates_on_plain_steps_only(tmp_path):
    job = _levers_job(tmp_path)
    policy, plan, _ = policy_for(job)
    assert isinstance(policy, PhasedPolicy) and plan.levers is None  # no levers before a calibration fit
    ctrl = policy.controller
    for step in range(5):  # fit_every 5: the fit after the fifth step
        d = policy.after_step(measured(ctrl.job, plan, step, 2.0), None)
    chosen = d.plan.levers
    assert ctrl.factors and ctrl.residual < 0.01  # the model fits these steps
    assert chosen is not None and chosen.any and chosen.policy_lag == 0
    assert chosen.predicted["base_s"] > chosen.predicted["step_s"]  # whole steps priced (padded rollouts)
    assert policy.levers.siblings == pytest.approx(0.9)  # tail batching priced at the measured correlation
    assert policy.levers.lengths(ctrl.job).sigma == pytest.approx(0.8)  # and spread
    rows, fitted = len(ctrl.calibrator._rows), dict(ctrl.factors)
    rounds = GenerationLevers(tail_batching=TailBatching(1.5))
    for step in range(5, 10):  # steps under levers: their times are not the plain plan's
        policy.after_step(measured(ctrl.job, plan, step, 0.5, rounds), None)
    assert ctrl.factors == fitted and len(ctrl.calibrator._rows) == rows
    # nor are a tail-batching round's lengths the step's draw: the length model keeps the plain steps'
    assert policy.levers.siblings == pytest.approx(0.9) and policy.levers.lengths(ctrl.job).sigma == 0.8


def _run(job, tmp_path, policy_of, ray_runtime):
    from nereus.run.job import RLJob

    rl = RLJob(job, runtime=ray_runtime, out_dir=tmp_path, quiet=True)
    rl.policy = policy_of(rl.policy)
    try:
        summary = rl.execute()
    finally:
        rl.release()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return rl, summary, rows


@pytest.mark.slow
@pytest.mark.distributed
def test_a_plan_with_speculation_speculates_in_the_fixed_batch(ray_runtime, tmp_path):
    job = tiny_job("grpo", str(tmp_path), steps=3, rollout={"levers": "auto"})
    spec = FixedSpeculation(Speculation("ngram", 2, 64))  # chosen after the first step (the job's plan is set)
    rl, summary, rows = _run(job, tmp_path, lambda p: PhasedPolicy("spec", p.inner, NoTail(), levers=spec), ray_runtime)
    entries = [GenerationEntry.from_json(d) for d in rl.record.generation_decisions]
    assert [e.step for e in entries] == [1, 2] and all(isinstance(e.decision, SetSpeculation) for e in entries)
    assert all(e.outcome.applied and e.outcome.figures["verifications"] > 0 for e in entries)
    assert rows[0]["rollout/spec_decode/num_drafts"] == 0.0 and rows[0]["nereus/levers/on"] == 0.0
    for r in rows[1:]:
        assert r["rollout/spec_decode/num_draft_tokens"] == 2 * r["rollout/spec_decode/num_drafts"] > 0
        assert r["nereus/levers/on"] == 1.0
    assert summary["levers"][0]["kinds"] == "speculation" and summary["levers"][0]["first_step"] == 1


@pytest.mark.slow
@pytest.mark.distributed
def test_a_plan_with_tail_batching_runs_short_and_long_rounds(ray_runtime, tmp_path):
    job = tiny_job("grpo", str(tmp_path), steps=5, rollout={"levers": "auto"})
    tail = FixedTailBatching(TailBatching(2.0))
    _, _, rows = _run(job, tmp_path, lambda p: PhasedPolicy("tail", p.inner, NoTail(), levers=tail), ray_runtime)
    assert "tail/long_round" not in rows[0]  # the job's own plan: no levers in its first step
    assert [r["tail/long_round"] for r in rows[1:]] == [0.0, 1.0, 0.0, 1.0]
    assert all(r["tail/kept_groups"] == 2.0 and r["rollout/policy_lag_max"] == 0.0 for r in rows[1:])


def test_held_plans_of_fixed_runs_calibrate_nothing(tmp_path):
    policy, _, _ = policy_for(tiny_job("grpo", str(tmp_path)))
    assert isinstance(policy, HeldPlan) and not policy.calibrate


def test_no_lever_whose_gain_is_within_the_calibration_s_error(tmp_path):
    job = _levers_job(tmp_path)
    policy, plan, _ = policy_for(job)
    for step in range(5):  # the stages' times jump 20-fold from step to step: a poor fit
        d = policy.after_step(measured(policy.controller.job, plan, step, 1.0 if step % 2 else 20.0), None)
    declined = d.plan.levers  # nothing on, the best priced kept for the log
    assert policy.controller.residual > 0.5 and not declined.any and declined.predicted["residual"] > 0.5
    line = change_line(5, declined)
    assert "none (best priced: speculation" in line and "within the calibration's" in line
    log = LeverLog()
    assert log.step_done(4, None, 0.3, declined)[1] == line and log.step_done(5, declined, 0.3, declined)[1] is None
