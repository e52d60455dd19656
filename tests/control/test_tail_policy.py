"""The controller's lever choice (``control.tail_policy``): speculation priced on the forecast, its acceptance
calibrated on what the engine measured, and the simulator measuring what the controller predicted."""

import inspect

import pytest

import nereus.control.tail_policy as levers_module
from nereus.control.backend import StepMetrics
from nereus.control.tail_policy import FixedSpeculation, NereusLevers, PaddedRest, padded_rest, speculation_decision
from nereus.cost.batching import Factors
from nereus.cost.generation import GenModel, forecast_lengths, no_move, run_bulk
from nereus.cost.hardware import Hardware
from nereus.cost.plan_cost import estimate_plan
from nereus.cost.stages import generation_replica
from nereus.cost.tail.lengths import GroupLengths, MeasuredLengths, RolloutPool
from nereus.cost.tail.speculative import Acceptance
from nereus.planner.search import search
from nereus.run.adaptive import policy_for
from nereus.sim.run import simulate
from nereus.spec.cluster import ClusterSpec, gpu_presets
from nereus.spec.generation import GenerationEntry, Outcome, SetSpeculation
from nereus.spec.levers import GenerationLevers, Speculation, TailBatching
from nereus.spec.model import PRESETS
from tests.control.test_controller import small_job, trace
from tests.run.jobs import tiny_job


def _forecast():
    job = small_job(16)
    hw = Hardware(job.cluster)
    plan = search(hw, job).plan
    model = GenModel.of(hw, job, plan, estimate_plan(hw, job, plan))
    return model, run_bulk(model, forecast_lengths(job.workload.response, job.sequences_per_step()), Factors())


def test_the_rule_picks_the_speculation_with_the_largest_predicted_gain():
    model, bulk = _forecast()
    choice = NereusLevers().choose(model, bulk, Factors(), policy_lag=0)
    assert choice is not None and choice.gain_s > 0
    spec = choice.levers.speculation
    assert spec.draft in ("ngram", "suffix") and 1 <= spec.live_at_most <= model.slots
    assert choice.levers.policy_lag == 0 and choice.levers.predicted["gain_s"] == pytest.approx(choice.gain_s)
    # with every draft rejected speculation never pays; tail batching (lag 0) still may
    hopeless = NereusLevers(acceptance={k: Acceptance(0.0, 1e6, "test") for k in ("ngram", "suffix")})
    other = hopeless.choose(model, bulk, Factors(), 0)
    assert other is None or (other.levers.speculation is None and other.levers.partial_rollout is None)
    decision = speculation_decision(choice.levers)
    assert isinstance(decision, SetSpeculation) and decision.speculation == spec
    fixed = FixedSpeculation(Speculation("ngram", 5, 32)).choose(model, bulk, Factors(), 0)
    assert fixed.levers.speculation == Speculation("ngram", 5, 32)


def test_the_rule_keeps_its_length_model_while_its_inputs_stay_and_prices_each_switch_pattern_once(monkeypatch):
    """Across the plans one decision prices (the pools' options), the length model and its quantiles are
    built once; speculation thresholds that switch every replica at the same moments are priced once."""
    job = tiny_job("grpo", "unused")
    rule = NereusLevers()
    first = rule.lengths(job)
    assert rule.lengths(job) is first
    rule.observe(StepMetrics(0, {}, {}, 1.0, 1.0, 1.0, 8, 1.0, length_sigma=0.3))
    assert rule.lengths(job) is not first and rule.lengths(job).sigma == 0.3
    model, _ = _forecast()
    replicas = model.placement.layout.dp  # two sequences a replica: every threshold from 2 up switches alike
    bulk = run_bulk(model, forecast_lengths(model.job.workload.response, 2 * replicas), Factors())
    calls = []
    real = levers_module.with_speculation

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(args[3])  # the live-batch threshold
        return real(*args, **kwargs)

    monkeypatch.setattr(levers_module, "with_speculation", counted)
    rule._speculation(model, bulk, Factors())
    patterns = {levers_module.switch_times(bulk, live).tobytes() for live in levers_module.powers_of_two(model.slots)}
    assert len(patterns) < len(levers_module.powers_of_two(model.slots))
    assert len(calls) == len(levers_module.DRAFT_LENGTHS) + len(patterns) - 1  # the coarse pass's own is kept


def test_acceptance_is_calibrated_on_the_engines_counts_not_read_from_the_trace():
    rule = NereusLevers()
    prior = rule.alpha("suffix")
    spec = Speculation("suffix", 4, 16)
    # 10,000 verifications with a mean acceptance length of 3.0 at k = 4: alpha ~ 0.76
    entry = GenerationEntry(0, "actor/generation", 0, 64, SetSpeculation(speculation=spec),
                            Outcome(True, "", 0.0, 1.0, {"accepted_tokens": 20_000.0, "verifications": 10_000.0}))
    rule.observe(StepMetrics(0, {}, {}, 1.0, 1.0, 1.0, 1, 1.0, generation=(entry,)))
    assert rule.alpha("suffix") > prior + 0.1 and rule.alpha("ngram") < rule.alpha("suffix")
    assert "trace" not in inspect.getsource(levers_module).replace("trace's", "")


def test_the_simulator_runs_the_speculation_the_controller_chose_and_reports_its_counts():
    record = simulate(small_job(16), trace(12), "nereus", seed=0, steps=12)
    acted = [GenerationEntry.from_json(d) for d in record.generation_decisions]
    specs = [e for e in acted if isinstance(e.decision, SetSpeculation)]
    assert specs and all(e.outcome.applied and e.outcome.figures["verifications"] > 0 for e in specs)
    assert all(s["policy_lag"] == [1.0] for s in record.steps)  # speculation is lossless: lag 0
    summary = record.summary()
    assert summary["policy_lag_mean"] == 0.0 and summary["on_policy_share"] == 1.0
    spec_like = simulate(small_job(16), trace(12), "spec-like", seed=0, steps=12)
    assert any(d["decision"]["kind"] == "set_speculation" for d in spec_like.generation_decisions)


def test_both_levers_are_priced_together_round_by_round():
    """Speculation inside tail batching's rounds: each round's generation shortened by what speculation
    saves on its lengths, so the pair is priced below either alone where both pay."""
    model, bulk = _forecast()
    rule = NereusLevers(siblings_measured=[0.8])
    base = no_move(model, bulk).generation_s
    lengths = rule.lengths(model.job)
    tail = rule._tail_batching(model, lengths, base, None)
    spec_s, spec = rule._speculation(model, bulk, Factors())
    both = rule._with_speculation(model, lengths, tail, spec, Factors(), base, None)
    assert both < min(tail[1], spec_s)
    choice = rule.choose(model, bulk, Factors(), policy_lag=0)
    assert choice.levers.speculation == spec and choice.levers.tail_batching == tail[0]
    assert choice.levers.predicted["generation_s"] == pytest.approx(both)


def test_a_padded_round_prices_its_width_free_part_whole_and_every_row_at_its_longest():
    """The runtime pads rollouts: a round of shorter responses shortens only the part of inference and
    training that grows with width (``PaddedRest.fixed_s`` stays), and the fixed batch runs every row to
    the round's longest, so a round's generation depends on its longest, not on the others' lengths."""
    rest = PaddedRest(1.0, 10.0, fixed_s=0.25)
    assert rest.at(30.0, 30.0) == pytest.approx(1.0) and rest.at(0.0, 30.0) == pytest.approx(0.25 + 0.75 * 10 / 40)
    hw = Hardware(ClusterSpec(gpu_presets()["H100"], nodes=1, gpus_per_node=8))
    replica = generation_replica(hw, PRESETS["qwen2.5-7b"], 1, 2)
    padded, live = RolloutPool(replica, 1, 64, 100.0, padded=True), RolloutPool(replica, 1, 64, 100.0)
    skewed, even = (10.0, 10.0, 10.0, 500.0), (500.0, 500.0, 500.0, 500.0)
    assert padded.seconds(64, skewed, 130.0, 500.0) == pytest.approx(padded.seconds(64, even, 500.0, 500.0))
    assert live.seconds(64, skewed, 130.0, 500.0) < live.seconds(64, even, 500.0, 500.0)
    for rollout, fixed_batch in (({}, True), ({"slots": 4}, False)):
        job = tiny_job("grpo", "unused", rollout=rollout)
        _, plan, _ = policy_for(job)
        rest = padded_rest(job, plan, {})
        assert 0 < rest.fixed_s < rest.seconds and rest.padded_generation == fixed_batch


def test_tail_batching_is_priced_on_the_measured_groups_of_plain_steps():
    """Where the backend reports its responses' lengths, the rule prices tail batching on the groups of the
    last plain steps once it has enough of them; a step run under tail batching (its rounds keep or defer
    groups by length) is not the step's draw and is left out."""
    job = tiny_job("grpo", "unused")
    g = job.algorithm.samples_per_prompt
    rule = NereusLevers()
    assert isinstance(rule.lengths(job), GroupLengths)  # nothing measured: the job's log-normal

    def step(i: int, lengths: tuple[float, ...], levers: GenerationLevers | None = None) -> StepMetrics:
        return StepMetrics(i, {}, {}, 1.0, 1.0, 1.0, len(lengths), 1.0, levers=levers, response_lengths=lengths)

    per_step = tuple(float(1 + (i // g) % 5) for i in range(8 * g))  # 8 groups of alike siblings, lengths 1-5
    for i in range(3):
        rule.observe(step(i, per_step))
    assert isinstance(rule.lengths(job), GroupLengths)  # 24 groups: not yet
    rule.observe(step(3, (99.0,) * (8 * g), GenerationLevers(tail_batching=TailBatching(1.5))))
    assert isinstance(rule.lengths(job), GroupLengths)  # a tail-batched step adds none
    rule.observe(step(4, per_step))
    measured = rule.lengths(job)
    assert isinstance(measured, MeasuredLengths) and len(measured.groups) == 32
    for i in range(5, 30):
        rule.observe(step(i, per_step))
    assert len(rule.lengths_measured) == levers_module.SIBLINGS_WINDOW  # a long run keeps the window only
    assert measured.group_quantile(0.5) == 2.5  # group lengths 1, 2, 3 eight times each, 4 and 5 four times
