"""Speculative decoding at sequence granularity (``cost.tail.spec_run``): the renewal count of tokens per
verification, speculation's gain in the tail and its loss at large batch, drawn vs expected iterations."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nereus.cost.batching import Factors
from nereus.cost.generation import BulkRun, GenModel, forecast_lengths, no_move, run_bulk
from nereus.cost.hardware import Hardware
from nereus.cost.plan_cost import estimate_plan
from nereus.cost.tail.spec_run import (
    SpecTable,
    switch_time,
    switch_times,
    tokens_per_iteration,
    with_speculation,
)
from nereus.cost.tail.speculative import expected_tokens
from nereus.planner.search import search
from tests.control.test_controller import small_job


@pytest.mark.parametrize(("alpha", "k"), [(0.0, 3), (0.5, 1), (0.62, 4), (0.9, 8)])
def test_tokens_per_iteration_is_leviathans_mean_with_its_variance(alpha, k):
    mean, var = tokens_per_iteration(alpha, k)
    assert mean == pytest.approx(expected_tokens(alpha, k))
    assert (var == 0.0) == (alpha == 0.0) and var <= k * k / 4 + 1e-9  # bounded on [1, k + 1]
    # the variance against a direct draw of 1 + min(G, k)
    rng = np.random.default_rng(0)
    draws = 1 + np.minimum(rng.geometric(1 - alpha, 200_000) - 1, k) if alpha > 0 else np.ones(10)
    assert draws.var() == pytest.approx(var, rel=0.05, abs=1e-6)


def _setup():
    job = small_job(16)
    hw = Hardware(job.cluster)
    plan = search(hw, job).plan
    model = GenModel.of(hw, job, plan, estimate_plan(hw, job, plan))
    bulk = run_bulk(model, forecast_lengths(job.workload.response, job.sequences_per_step()), Factors())
    return model, bulk


def test_speculation_shortens_the_tail_and_costs_the_same_without_accepted_drafts():
    model, bulk = _setup()
    base = no_move(model, bulk).generation_s
    good = with_speculation(model, bulk, 4, model.slots, 0.7, Factors())
    assert good.outcome.generation_s < 0.8 * base and good.switched == len(bulk.runs)
    assert good.accepted_tokens == pytest.approx(good.spec_tokens - good.verifications)
    useless = with_speculation(model, bulk, 4, model.slots, 0.0, Factors())  # every draft rejected
    assert useless.outcome.generation_s > base  # verifying k + 1 rows and drafting cost more than one
    off = with_speculation(model, bulk, 4, 0, 0.7, Factors())  # never at most 0 live: never on
    assert off.switched == 0 and off.outcome.generation_s == pytest.approx(base)


def test_verification_turns_compute_bound_at_large_batch():
    model, _ = _setup()
    plain = model.table(model.placement.layout.tp)
    spec = SpecTable(plain, 7)
    ctx = np.array([0.0])
    small, large = np.array([4]), np.array([1024])
    ratio_small = spec.seconds(small, ctx, Factors())[0] / plain.seconds(small, ctx, Factors())[0]
    ratio_large = spec.seconds(large, ctx, Factors())[0] / plain.seconds(large, ctx, Factors())[0]
    assert ratio_small < 1.3 and ratio_large > 1.5 * ratio_small  # weights read once; 8x the FLOPs at large batch


def test_drawn_iterations_average_to_the_expected_ones():
    model, bulk = _setup()
    expected = with_speculation(model, bulk, 3, 16, 0.6, Factors())
    drawn = [with_speculation(model, bulk, 3, 16, 0.6, Factors(), np.random.default_rng(s)) for s in range(5)]
    mean = sum(d.verifications for d in drawn) / len(drawn)
    assert mean == pytest.approx(expected.verifications, rel=0.01)
    assert len({round(d.verifications) for d in drawn}) > 1  # drawn, not the expectation
    assert switch_time(bulk, 0, 10**6) <= switch_time(bulk, 0, 16) <= switch_time(bulk, 0, 1)


@given(sequences=st.integers(1, 40), replicas=st.integers(1, 9), live_at_most=st.integers(0, 12),
       seed=st.integers(0, 10**6), ties=st.booleans())
def test_every_replicas_switch_time_at_once_equals_each_one_alone(sequences, replicas, live_at_most, seed, ties):
    """Sequence i on replica i mod R (as ``run_bulk`` lays them), with fewer sequences than replicas, counts
    not divisible by R, and tied start and finish times (``ties``: whole seconds)."""
    rng = np.random.default_rng(seed)
    start = rng.uniform(0, 5, sequences)
    finish = start + rng.uniform(0.1, 10, sequences)
    if ties:
        start, finish = np.floor(start), np.floor(start) + np.ceil(finish - start)
    bulk = BulkRun(np.ones(sequences), np.arange(sequences) % replicas, start, finish, [None] * replicas, 1,
                   np.zeros(sequences, np.int64))
    one_by_one = [switch_time(bulk, r, live_at_most) for r in range(replicas)]
    assert switch_times(bulk, live_at_most).tolist() == one_by_one
