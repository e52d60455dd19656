"""The pool split (``control.pools``): one-step-off asynchrony chosen by the cost model at ``run.policy_lag``
>= 1 — both pools laid out by the planner, the step priced as ``cost.tail.async_split`` prices it, and the
simulator running what was chosen."""

from dataclasses import replace

import pytest

from nereus.control.backend import Decision, StepMetrics
from nereus.control.pools import (
    MEASURE_STEPS,
    ROLLOUT,
    PoolMove,
    PoolRule,
    pools_of,
    rollout_at_tp,
    rollout_tp_constraints,
    runs_apart,
    split_constraints,
)
from nereus.control.tail_policy import NereusLevers
from nereus.cost.hardware import Hardware
from nereus.cost.tail.async_split import async_step
from nereus.planner.search import Constraints, search
from nereus.sim.backend import TruthConfig
from nereus.sim.baselines import make_policy
from nereus.sim.reality import NO_REALITY
from nereus.sim.run import simulate, simulate_with_backend
from nereus.sim.step_timeline import step_rows
from nereus.spec import load_job
from nereus.spec.capability import RuntimeCapability
from nereus.spec.job import ResponseLength
from nereus.spec.trace import load_trace
from tests.conftest import EXAMPLES, ROOT
from tests.control.test_controller import small_job


def _long_tail_job():
    return load_job(EXAMPLES / "grpo_7b_h100.yaml")


def test_the_split_constraints_put_the_rollout_alone_on_its_pool():
    job = small_job(16)
    plan = search(Hardware(job.cluster), job, constraints=split_constraints(job, 4)).plan
    assert len(plan.placement(str(ROLLOUT)).gpus) == 4 and runs_apart(plan)
    assert all(p.layout.world <= 12 for p in plan.placements if p.model_stage != ROLLOUT)
    colocated = search(Hardware(job.cluster), job).plan
    assert not runs_apart(colocated) or colocated.strategy != "colocated"


def test_on_policy_the_rule_keeps_the_planners_plan_unless_another_rollout_tp_pays():
    job = _long_tail_job()
    planned = search(Hardware(job.cluster), job).plan
    kept = PoolRule(min_gain=1.0).choose(job, {}, NereusLevers(), 0, None)
    assert kept.gen_gpus is None and kept.plan == planned
    # its rollout TP pinned all the same: the controller's search ranks rollout layouts without the levers
    rollout = planned.placement(str(ROLLOUT)).layout
    pinned = kept.constraints.layout_filter
    assert pinned(ROLLOUT, rollout) and not pinned(ROLLOUT, replace(rollout, tp=rollout.tp // 2, dp=rollout.dp * 2))
    assert PoolRule().choose(job, {}, None, 0, None).plan == planned  # no levers: nothing to price them with


def test_the_rollout_tp_is_chosen_with_the_levers_priced_on_it():
    """The planner ranks rollout layouts without the levers; on the 7B GRPO job (2,048 sequences a step) it
    puts 256 sequences on each TP-4 replica, where speculation's verification is compute-bound longer than
    on TP-2 replicas of 128: with the levers priced, TP 2 pays at r1_zero_growth's first lengths, and the
    choice pins it for the controller. At the job's own longer lengths TP 4 stays."""
    job = _long_tail_job().with_response(ResponseLength(1500, 8192, "lognormal", 0.7))
    rule, levers = PoolRule(), NereusLevers()
    planned = search(Hardware(job.cluster), job).plan
    own = rule.price(job, {}, levers, 0, planned)
    choice = rule.choose(job, {}, levers, 0, None)
    tp = choice.plan.placement(str(ROLLOUT)).layout.tp
    assert planned.placement(str(ROLLOUT)).layout.tp == 4 and tp == 2 and choice.gen_gpus is None
    assert choice.step_s < own.step_s * (1 - rule.min_gain)
    assert choice.levers is not None and choice.levers.speculation is not None
    pinned = choice.constraints.layout_filter
    rollout = planned.placement(str(ROLLOUT))
    assert not pinned(ROLLOUT, rollout.layout) and pinned(ROLLOUT, replace(rollout.layout, tp=2, dp=16))
    training = next(p for p in planned.placements if p.model_stage.stage == "training")
    assert pinned(training.model_stage, training.layout)  # only the rollout is pinned
    # the controller plans under the pin from the start
    policy = make_policy("nereus", job, policy_lag=0)
    assert policy.initial_plan(job.cluster.num_gpus).placement(str(ROLLOUT)).layout.tp == 2
    longer = rule.choose(_long_tail_job(), {}, levers, 0, None)
    assert longer.plan.placement(str(ROLLOUT)).layout.tp == 4
    assert not longer.constraints.layout_filter(ROLLOUT, replace(rollout.layout, tp=2, dp=16))


def test_the_rollout_is_re_laid_at_another_tp_on_its_own_gpus_alone():
    job = _long_tail_job()
    planned = search(Hardware(job.cluster), job).plan
    plan, est = rollout_at_tp(job, planned, 2, {})
    rollout = plan.placement(str(ROLLOUT))
    assert rollout.layout.tp == 2 and rollout.gpus == planned.placement(str(ROLLOUT)).gpus and est.feasible
    assert [p for p in plan.placements if p.model_stage != ROLLOUT] == \
        [p for p in planned.placements if p.model_stage != ROLLOUT]
    assert rollout_at_tp(job, planned, 2, {}, lambda ms, lay: lay.pp > 8) is None  # nothing allowed


def test_a_pinned_rollout_tp_and_a_split_keep_the_runtimes_capability():
    cap = RuntimeCapability(padded_rollouts=True)
    pinned = rollout_tp_constraints(Constraints(capability=cap), 2)
    assert pinned.capability is cap
    assert rollout_tp_constraints(None, 2).capability is None
    assert split_constraints(small_job(16), 4, None, cap).capability is cap


def test_a_long_tail_at_one_step_of_lag_runs_one_step_off_priced_as_the_async_step():
    job = _long_tail_job()
    levers = NereusLevers()
    colocated = PoolRule().choose(job, {}, levers, 0, None)
    choice = PoolRule().choose(job, {}, levers, 1, None)
    assert choice.gen_gpus is not None and runs_apart(choice.plan)
    assert len(choice.plan.placement(str(ROLLOUT)).gpus) == choice.gen_gpus
    assert choice.step_s < colocated.step_s * (1 - PoolRule().min_gain)
    split = choice.levers.async_split
    assert split.generation_gpus == choice.gen_gpus and choice.levers.policy_lag == 1
    assert choice.levers.partial_rollout is None  # the split spends the one step of lag allowed
    p = choice.predicted
    expected = async_step(choice.gen_gpus, job.cluster.num_gpus - choice.gen_gpus, p["async_gen_s"],
                          p["async_train_s"], p["async_sync_s"])
    assert choice.step_s == pytest.approx(expected.step_s)
    # a rule that demands more than any split can give keeps the colocated plan
    assert PoolRule(min_gain=1.0).choose(job, {}, levers, 1, None).gen_gpus is None


def test_nereus_at_one_step_of_lag_trains_one_step_old_tokens_on_its_split():
    job = _long_tail_job()
    trace = load_trace(ROOT / "traces" / "r1_zero_growth.yaml")
    record = simulate(job, trace, "nereus", 0, 4, policy_lag=1)
    assert all(s["policy_lag"] == [0.0, 1.0] for s in record.steps)
    policy = make_policy("nereus", job, policy_lag=1)
    plan = policy.initial_plan(job.cluster.num_gpus)
    assert plan.levers.async_split is not None and runs_apart(plan)
    on_policy = make_policy("nereus", job, policy_lag=0).initial_plan(job.cluster.num_gpus)
    assert on_policy.levers is None or on_policy.levers.async_split is None


def test_the_step_timeline_draws_the_training_pool_beside_the_rollout():
    job = _long_tail_job()
    trace = load_trace(ROOT / "traces" / "r1_zero_growth.yaml")
    record, backend = simulate_with_backend(job, trace, "nereus", 0, 2, policy_lag=1)
    rows = step_rows(backend.last_generation)
    pool = [r for r in rows if r[0].endswith("(training pool)")]
    assert [kind for _, kind, _, _ in pool][:2] == ["inference", "training"] and pool[0][2] == 0.0
    generation_end = max(b for g, kind, _, b in rows if kind in ("bulk", "speculation"))
    sync = [a for g, kind, a, _ in rows if kind == "weight_sync"]
    assert sync and min(sync) == pytest.approx(max(generation_end, pool[1][3]))
    assert max(b for *_, b in rows) == pytest.approx(record.steps[-1]["step_time_s"], rel=1e-6)


def test_the_pools_are_chosen_on_the_priors_then_on_the_calibration():
    """At the start on the priors; at a GPU change on the calibrated model (fitted on plain-equivalent
    generation times, so a lever's gain is priced once: growth_from_16 at lag 1, 8B PPO, whole trace,
    seed 0: 30.3 s mean step, 31.7 s with the choice on the priors)."""
    job = _long_tail_job()
    policy = make_policy("nereus", job, policy_lag=1)
    seen = []

    class Recording(PoolRule):
        def choose(self, job, factors, *args, **kwargs):
            seen.append(dict(factors))
            return super().choose(job, factors, *args, **kwargs)

    policy.pools = Recording()
    policy.initial_plan(job.cluster.num_gpus)
    policy.controller.factors = {"generation.memory": 0.6}  # a fit that cuts generation's weight reads
    policy.survivor_plan(job.cluster.num_gpus // 2, 10)
    assert seen == [{}, {"generation.memory": 0.6}]


def test_the_recheck_moves_the_pools_only_where_the_calibration_says_the_others_pay():
    job, rule, levers = _long_tail_job(), PoolRule(), NereusLevers()
    start = rule.choose(job, {}, levers, 1, None)
    assert start.gen_gpus == 16 and rule.recheck(job, {}, levers, 1, None, start.plan) is None  # same model
    dearer_training = {"training.compute": 3.0, "inference.compute": 3.0}
    current, choice = rule.recheck(job, dearer_training, levers, 1, None, start.plan)
    assert current.gen_gpus == 16 and choice.gen_gpus == 8  # the training pool grows
    assert choice.step_s < current.step_s * (1 - rule.switch_gain)
    dearer_generation = {"generation.memory": 3.0, "generation.compute": 3.0}
    current, choice = rule.recheck(job, dearer_generation, levers, 1, None, start.plan)
    assert choice.gen_gpus is None and not runs_apart(choice.plan)  # every GPU generates, then trains
    assert rule.recheck(job, dearer_training, levers, 1, None, start.plan) is not None
    assert PoolRule(switch_gain=0.9).recheck(job, dearer_training, levers, 1, None, start.plan) is None


def test_a_run_moves_its_pools_on_the_recheck_and_records_why():
    """GRPO on r1_zero_growth at lag 1 under seed 3's truth (decoding's compute 1.67x the model's): the
    split chosen on the priors is re-priced every ``PoolRule.every`` steps on the calibration, and the
    rollout moves back among the other models (then to another TP), each move predicted to pay. The
    scenario is set on the cost model's own truth, without the driver pass and stragglers (sim.reality)."""
    job = _long_tail_job()
    trace = load_trace(ROOT / "traces" / "r1_zero_growth.yaml")
    record = simulate(job, trace, "nereus", 3, 120, truth=TruthConfig(reality=NO_REALITY), policy_lag=1)
    moves = [d for d in record.decisions if d.get("reason", "").startswith("pools on the calibrated model")]
    assert moves and all((d["step"] + 1) % PoolRule().every == 0 for d in moves)
    assert all(d["candidate_s"] < d["current_s"] * (1 - PoolRule().switch_gain) for d in moves)
    assert "colocated" in moves[0]["reason"] and record.steps[-1]["strategy"] == "colocated"


def test_a_pool_move_that_measures_slower_than_before_it_is_undone():
    """The calibration prices pools it never measured by extrapolation; a move is on trial for
    ``MEASURE_STEPS`` steps and goes back to the plan it left when it delivers fewer tokens per second than
    the steps before it (by ``switch_gain``); those pools then wait four re-checks."""
    job = _long_tail_job()
    colocated = PoolRule().choose(job, {}, NereusLevers(), 0, None)

    def judged(after_tokens_per_s: float):
        policy = make_policy("nereus", job, policy_lag=1)
        policy.initial_plan(job.cluster.num_gpus)
        ctrl = policy.controller
        split, split_constraints_ = ctrl.plan, ctrl.constraints
        policy._move = PoolMove(50, 100.0, split, split_constraints_, pools_of(colocated))
        ctrl.plan, ctrl.constraints = colocated.plan, colocated.constraints
        policy._recent = [(after_tokens_per_s, 1.0)] * MEASURE_STEPS
        m = StepMetrics(50 + MEASURE_STEPS - 1, {}, {}, 1.0, 1000.0, 2000.0, 2048, after_tokens_per_s)
        return policy, split, policy._judge_pool_move(m, Decision(m.step, "keep", "")), split_constraints_

    policy, split, d, before = judged(90.0)
    assert d.action == "transition" and d.plan == split and "undone" in d.reason
    assert policy.controller.plan == split and policy.controller.constraints is before
    assert policy._undone == {pools_of(colocated): 50 + MEASURE_STEPS} and policy._move is None
    policy, _, d, _ = judged(97.0)  # within switch_gain: kept
    assert d.action == "keep" and policy.controller.plan == colocated.plan and policy._move is None
