"""The tail levers' pricing (nereus.cost.tail): formulas, limits, and the published figures they must meet.

Speculative decoding's published speedups are in test_spec_published.py; here: its formula and cost
pieces, GRPO group lengths with alike siblings, tail batching (RollPacker), partial rollout (Kimi k1.5,
APRIL) and bounded asynchrony (verl's one-step-off table).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from nereus.cost.decode import Replica, StepModel, decode_phases
from nereus.cost.hardware import Hardware
from nereus.cost.stages import generation_replica
from nereus.cost.tail import speculative as sp
from nereus.cost.tail.async_split import async_step, best_split, speedup_over_colocated
from nereus.cost.tail.lengths import GroupLengths, MeasuredLengths, RolloutPool, measured_groups
from nereus.cost.tail.partial_rollout import best_budget, budget_for_lag, partial_rollout
from nereus.cost.tail.tail_batching import best_over_launch, tail_batching
from nereus.spec.cluster import ClusterSpec, gpu_presets
from nereus.spec.model import PRESETS
from nereus.spec.response import ResponseLength
from nereus.spec.trace import DRAFT_KINDS

DAPO = ResponseLength(3000, 20480, sigma=1.0)  # traces/long_tail_dapo.yaml at its first step


def h100(nodes: int = 1) -> Hardware:
    return Hardware(ClusterSpec(gpu_presets()["H100"], nodes=nodes, gpus_per_node=8))


def pool(tp: int = 2, replicas: int = 16) -> RolloutPool:
    """The 7B GRPO job's rollout (examples/grpo_7b_h100.yaml: 32 H100, 128 prompts x 16)."""
    return RolloutPool(generation_replica(h100(4), PRESETS["qwen2.5-7b"], tp, 2), replicas, 512, 512)


# --- speculative decoding -------------------------------------------------------------------------------

def test_draft_kinds_are_the_traces():
    assert tuple(k.value for k in sp.DraftKind) == DRAFT_KINDS
    assert {k for k, _ in sp.PRIORS} == set(sp.DraftKind)


@pytest.mark.parametrize(("alpha", "k", "tokens"), [(0.0, 4, 1.0), (0.5, 1, 1.5), (0.5, 3, 1.875), (1.0, 4, 5.0),
                                                    (0.8, 0, 1.0)])
def test_expected_tokens_is_leviathans_formula(alpha, k, tokens):
    assert sp.expected_tokens(alpha, k) == pytest.approx(tokens)


def test_acceptance_length_inverts_and_calibration_moves_the_prior():
    for alpha, k in ((0.3, 2), (0.75, 4), (0.9, 7)):
        assert sp.alpha_from_acceptance_length(sp.expected_tokens(alpha, k), k) == pytest.approx(alpha, abs=1e-6)
    prior = sp.prior(sp.DraftKind.SUFFIX)
    # 1,000 verifications of k = 4 that accepted 2 tokens each on average: AL 3.0, α ≈ 0.72
    post = prior.observe(accepted_tokens=2000, verifications=1000, k=4)
    measured = sp.alpha_from_acceptance_length(3.0, 4)
    assert prior.alpha < post.alpha < measured and post.weight == prior.weight + 1000
    assert post.alpha == pytest.approx((prior.alpha * 100 + measured * 1000) / 1100)
    assert prior.observe(0, 0, 4) == prior


def test_verification_of_one_token_is_a_plain_step_and_grows_with_rows():
    m = StepModel(generation_replica(h100(), PRESETS["llama3-8b"], 1, 2))
    for b, c in ((1, 512), (64, 2048), (512, 1024)):
        assert sp.verify_seconds(m, b, c, 1) == pytest.approx(m.step(b, c).total)
    assert sp.verify_seconds(m, 1, 512, 5) == pytest.approx(m.step(1, 512).total, rel=0.01)  # weight-read bound
    assert sp.verify_seconds(m, 512, 512, 5) > 2 * m.step(512, 512).total  # FLOP-bound at 2,560 rows


def test_drafting_costs_and_memory_by_kind():
    m = StepModel(generation_replica(h100(), PRESETS["llama3-8b"], 1, 2))
    ngram, head = sp.ngram_drafter(), sp.draft_head(PRESETS["llama3-8b"], vocab=32000)
    assert sp.draft_seconds(m, ngram, 8, 1000, 4) == pytest.approx(8 * sp.MODEL_FREE_HOST_S)
    assert sp.draft_seconds(m, head, 8, 1000, 4) > 4 * m.replica.costs.step_s  # four forwards, each its host cost
    assert sp.draft_memory_bytes(ngram, 1, 1e6) == 0
    small = sp.draft_model(PRESETS["qwen2.5-0.5b"])
    one_layer = PRESETS["llama3-8b"].layer_params() + 32000 * 4096 + 4096
    assert sp.draft_memory_bytes(head, 1, 0) == pytest.approx(2 * one_layer, rel=0.01)
    assert sp.draft_memory_bytes(small, 2, 1e5) > sp.draft_memory_bytes(small, 2, 0)


def test_best_k_is_off_when_nothing_pays_and_the_tail_gains():
    m = StepModel(generation_replica(h100(), PRESETS["llama3-8b"], 1, 2))
    useless = sp.suffix_drafter().with_alpha(0.0, "never accepted")
    assert sp.best_k(m, useless, 4, 1000).k == 0 and sp.best_k(m, useless, 4, 1000).speedup == 1.0
    phases = decode_phases(m.replica, 512, 256, 256, DAPO.quantiles(16), DAPO.mean, 20480)
    fast = sp.generation_seconds(phases, m, sp.suffix_drafter(), 512 + DAPO.mean)
    assert phases.prefill_s < fast < phases.total_s
    assert sp.generation_seconds(phases, m, useless, 512 + DAPO.mean) == pytest.approx(phases.total_s)


# --- group lengths ----------------------------------------------------------------------------------------

def test_the_marginal_is_the_traces_lognormal_for_any_sibling_correlation():
    reference = DAPO.quantiles(16)
    for rho in (0.0, 0.5, 0.95):
        q = GroupLengths.of(DAPO, rho, 16).response_quantiles(16)
        assert q == pytest.approx(reference, rel=1e-3)


def test_alike_siblings_finish_together_and_deferred_prompts_stay_long():
    independent, alike = GroupLengths.of(DAPO, 0.0, 16), GroupLengths.of(DAPO, 0.9, 16)
    x = 5000.0
    assert independent.group_cdf(x) == pytest.approx(independent.response_cdf(x) ** 16, rel=1e-9)
    assert alike.group_cdf(x) > independent.group_cdf(x)  # a group's longest is closer to a single response
    stop = 4000.0
    assert sum(independent.deferred_quantiles(stop)) == pytest.approx(sum(independent.response_quantiles()), rel=1e-3)
    assert sum(alike.deferred_quantiles(stop)) > 1.5 * sum(alike.response_quantiles())
    assert alike.kept_mean(stop) < stop and alike.kept_mean(stop) < alike.mean


def test_a_length_models_answers_are_kept_per_question_and_equal_a_fresh_ones():
    """The quantiles are kept on the (frozen) instance: asked again, or with other arguments, each answer is
    the one a fresh instance computes for those arguments."""
    kept = GroupLengths.of(DAPO, 0.5, 16)
    for stop in (2000.0, 4000.0, 2000.0):
        fresh = GroupLengths.of(DAPO, 0.5, 16)
        assert kept.deferred_quantiles(stop) == fresh.deferred_quantiles(stop)
        assert kept.deferred_longest(stop, 64) == fresh.deferred_longest(stop, 64)
        assert kept.kept_mean(stop) == fresh.kept_mean(stop)
    assert kept.deferred_quantiles(2000.0) != kept.deferred_quantiles(4000.0)
    assert kept.response_quantiles(8) == GroupLengths.of(DAPO, 0.5, 16).response_quantiles(8)
    assert len(kept.response_quantiles(8)) == 8 and len(kept.response_quantiles(16)) == 16
    assert kept == GroupLengths.of(DAPO, 0.5, 16)  # what it has answered is no part of its value


# --- tail batching (RollPacker) -----------------------------------------------------------------------------

def test_tail_batching_without_over_launch_is_the_synchronous_round():
    g = GroupLengths.of(DAPO, 0.5, 16)
    off = tail_batching(pool(), g, 128, 1.0)
    assert off.speedup == pytest.approx(1.0) and off.wasted_share == 0.0 and off.policy_lag == 0


def test_tail_batching_shortens_the_round_more_when_siblings_are_alike():
    """RollPacker (arXiv 2509.21009) reports 2.03-2.56x end to end over verl with tail batching, stream
    training and a TP per round type; tail batching alone must give a gain of the same sign and no more
    than that: measured 1.19x (ρ 0), 1.29x (ρ 0.5) and 1.53x (ρ 0.9) of generation at the best factor."""
    gains = []
    for rho in (0.0, 0.5, 0.9):
        best = best_over_launch(pool(), GroupLengths.of(DAPO, rho, 16), 128)
        assert 1.05 < best.speedup < 2.56 and best.over_launch > 1.0
        assert 0 < best.wasted_share < 0.5 and best.stop_length < 20480
        gains.append(best.speedup)
    assert gains == sorted(gains)
    est = tail_batching(pool(), GroupLengths.of(DAPO, 0.5, 16), 128, 2.0)
    assert est.long_rounds_per_short == 1.0 and est.long.longest >= est.short.longest


def test_a_wider_layout_for_long_rounds_is_priced():
    g = GroupLengths.of(DAPO, 0.5, 16)
    same = tail_batching(pool(), g, 128, 1.5)
    wide = tail_batching(pool(), g, 128, 1.5, long_pool=pool(tp=4, replicas=8))
    assert wide.short == same.short and wide.long.seconds != same.long.seconds


# --- partial rollout ---------------------------------------------------------------------------------------

def test_partial_rollout_lags_and_budget_bounds():
    g = GroupLengths.of(DAPO, 0.5, 16)
    whole = partial_rollout(pool(), g, 2048, 20480)
    assert whole.lag_shares == (1.0,) and whole.carried_share == 0 and whole.speedup == pytest.approx(1.0, abs=0.02)
    assert budget_for_lag(20480, 1) == 10240 and budget_for_lag(20480, 0) == 20480
    for lag in (1, 2, 4):
        est = partial_rollout(pool(), g, 2048, budget_for_lag(20480, lag))
        assert est.max_lag == lag and sum(est.lag_shares) == pytest.approx(1.0)
        assert est.lag_shares[0] > 0.5 and est.in_flight > 2048
    speedups = [partial_rollout(pool(), g, 2048, t).speedup for t in (20480, 10240, 5120, 2560)]
    assert speedups == sorted(speedups)


def test_partial_rollout_meets_aprils_gain():
    """APRIL (arXiv 2509.18521) reports +22.5% rollout throughput on average (GRPO, DAPO, GSPO) from
    carrying unfinished responses; one step of lag on the DAPO trace must gain at least that."""
    est = best_budget(pool(), GroupLengths.of(DAPO, 0.5, 16), 2048, policy_lag=1)
    assert est.max_lag <= 1 and est.speedup >= 1.225
    on_policy = best_budget(pool(), GroupLengths.of(DAPO, 0.5, 16), 2048, policy_lag=0)
    assert on_policy.speedup == pytest.approx(1.0, abs=0.02)


# --- bounded asynchrony ------------------------------------------------------------------------------------

# verl docs/advance/one_step_off.md (Qwen2.5-Math-7B, DAPO, 2 x 16 H20: 4 generation GPUs, 12 training):
# (engine, colocated step, gen, old_log_prob, update_actor, async step, generate_sequences on 4, old_log_prob
# and update_actor on 12).
ONE_STEP_OFF = [("FSDP2", 749, 321, 88, 286, 520, 458, 108, 337), ("Megatron", 699, 207, 119, 344, 566, 501, 120, 347)]


@pytest.mark.parametrize("row", ONE_STEP_OFF, ids=[r[0] for r in ONE_STEP_OFF])
def test_one_step_off_reproduces_verls_table(row):
    """Each pool's stage times from the async row, the rest of a step (reward, advantage, bookkeeping:
    the colocated step minus its three stages) from the colocated row, weight sync 0.3 s ("under
    300 ms"): the step within 10% of verl's (measured −1.5% FSDP2, −6.3% Megatron)."""
    _, co_step, co_gen, co_lp, co_up, async_published, gen4, lp12, up12 = row
    other = co_step - (co_gen + co_lp + co_up)
    est = async_step(4, 12, gen4, lp12 + up12, 0.3)
    assert est.step_s + other == pytest.approx(async_published, rel=0.10)
    assert est.idle_train_s == pytest.approx(gen4 - lp12 - up12) and est.staleness == 1
    with_other = async_step(4, 12, gen4, lp12 + up12, 0.3 + other)  # the rest of the step runs on its own
    assert speedup_over_colocated(with_other, co_gen + other, co_lp + co_up) == pytest.approx(
        co_step / async_published, rel=0.10)  # published 1.44x and 1.23x


def test_best_split_balances_the_pools():
    gen = {g: 1000 / g + 20 for g in (8, 16, 24, 32, 40, 48, 56)}  # generation: bulk over GPUs + a fixed tail
    train = {t: 1600 / t for t in (8, 16, 24, 32, 40, 48, 56)}
    best = best_split(gen, train, 64, sync_s=0.3)
    assert best.gen_gpus + best.train_gpus == 64
    assert best.step_s == min(max(gen[g], train[64 - g]) + 0.3 for g in gen if 64 - g in train)
    with pytest.raises(ValueError, match="at least one step of lag"):
        async_step(8, 56, 1.0, 1.0, 0.1, staleness=0)
    with pytest.raises(ValueError, match="no split of 64 GPUs"):
        best_split({8: 1.0}, {8: 1.0}, 64, 0.1)
    assert math.isfinite(best.idle_gen_s + best.idle_train_s)


def test_replica_is_hashable_for_the_draft_cache():
    r = generation_replica(h100(), PRESETS["llama3-8b"], 2, 2)
    assert isinstance(r, Replica) and hash(r) == hash(generation_replica(h100(), PRESETS["llama3-8b"], 2, 2))


def test_sibling_correlation_is_the_intraclass_correlation_of_log_lengths():
    from nereus.cost.tail.lengths import sibling_correlation

    e = math.e
    # log lengths (0, 1) and (2, 3): MSB = 2·(1 + 1)/1 = 4, MSW = 4·0.25/2 = 0.5, ICC(1) = 3.5/4.5
    assert sibling_correlation([1, e, e**2, e**3], 2) == pytest.approx(3.5 / 4.5)
    assert sibling_correlation([3, 3, 9, 9, 2, 2], 2) == 0.99  # siblings identical: clipped below 1
    assert sibling_correlation([1, e**3, e, e**2], 2) == 0.0  # more spread within groups than between
    assert sibling_correlation([5, 5, 5, 5], 2) is None and sibling_correlation([1, 2, 3], 4) is None
    assert sibling_correlation([1, 2, 3, 4], 1) is None  # no siblings


def test_measured_lengths_answer_from_the_groups_themselves():
    """``MeasuredLengths`` takes quantiles of the measured draws: a group finishes with its longest response,
    a short round keeps the groups done by its stop, the rest are the deferred prompts' lengths."""
    groups = ((2.0, 3.0), (4.0, 4.0), (5.0, 9.0), (30.0, 37.0))
    m = MeasuredLengths(groups, 37)
    assert m.group_size == 2 and m.mean == pytest.approx(sum(sum(g) for g in groups) / 8)
    assert m.group_quantile(0.5) == pytest.approx(6.5)  # group maxima 3, 4, 9, 37: halfway between 4 and 9
    assert m.group_quantile(1.0) == 37.0
    assert m.kept_mean(4.0) == pytest.approx(13 / 4)  # the first two groups
    assert m.deferred_quantiles(4.0, 2) == pytest.approx(tuple(np.quantile([5, 9, 30, 37], [0.25, 0.75])))
    assert m.deferred_longest(40.0, 8) == 40.0  # nothing deferred past every length: the stop itself
    assert measured_groups([1, 2, 3, 4, 5], 2) == ((1.0, 2.0), (3.0, 4.0))  # a partial group is left out


def test_tail_batching_on_measured_pareto_lengths_stops_where_the_groups_do():
    """On lengths drawn from the ``repeat`` task's law (P(k ≥ n) = 2/(n + 1), capped) the short round's stop
    is the measured groups' 1/f quantile, well below what a log-normal of the same mean and spread gives."""
    rng = np.random.default_rng(0)
    k = np.minimum(36, np.floor(2 / (1 - rng.random(400))) - 1)
    groups = tuple((x + 1.0,) * 8 for x in k)  # alike siblings: the model answers each prompt's length
    measured = MeasuredLengths(groups, 37)
    hw = Hardware(ClusterSpec(gpu_presets()["H100"], nodes=1, gpus_per_node=8))
    pool = RolloutPool(generation_replica(hw, PRESETS["qwen2.5-7b"], 1, 2), 2, 64, 12.0, padded=True)
    est = tail_batching(pool, measured, 16, 1.5)
    assert est.stop_length == pytest.approx(np.quantile([g[0] for g in groups], 1 / 1.5))
    assert est.stop_length <= 7  # the P-th of 1.5 P groups: k about 5
    sigma = float(np.log(np.concatenate([np.asarray(g) for g in groups])).std())
    fitted = GroupLengths(measured.mean, 37, sigma, 0.95, 8)
    assert tail_batching(pool, fitted, 16, 1.5).stop_length > 1.5 * est.stop_length
