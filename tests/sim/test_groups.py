"""Prompt groups in the simulator: siblings alike at the trace's correlation, and tail batching's short
rounds (keep the first groups to end) and long rounds (the deferred prompts, regenerated)."""

import math

import numpy as np
import pytest

from nereus.sim.backend import SimBackend
from nereus.sim.groups import draw_groups, stop_round
from nereus.sim.run import simulate
from nereus.spec import job_from_dict
from nereus.spec.response import ResponseLength
from nereus.spec.trace import trace_from_dict


def test_siblings_share_their_prompts_difficulty_and_keep_the_marginal():
    resp = ResponseLength(2000, 10**6, "lognormal", 0.8)
    rng = np.random.default_rng(0)
    lengths = draw_groups(rng, resp, rng.standard_normal(4000), 8, 0.5)
    logs = np.log(lengths).reshape(4000, 8)
    within = np.corrcoef(logs[:, 0], logs[:, 1])[0, 1]
    assert within == pytest.approx(0.5, abs=0.05)
    assert lengths.mean() == pytest.approx(2000, rel=0.03) and np.log(lengths).std() == pytest.approx(0.8, rel=0.03)


def test_a_short_round_keeps_the_first_groups_to_end():
    finish = np.array([1.0, 5.0, 2.0, 2.5, 9.0, 0.5, 3.0, 3.5])  # four groups of two: ends 5, 2.5, 9, 3.5
    sr = stop_round(finish, 2, 2)
    assert sr.stop_s == 3.5 and sr.kept.tolist() == [False, True, False, True]
    assert sr.kept_sequences(2).tolist() == [False, False, True, True, False, False, True, True]


def _grpo(gpus=16):
    return job_from_dict({
        "name": "grpo-small", "models": {m: {"preset": "qwen2.5-0.5b"} for m in ("actor", "reference")},
        "algorithm": {"name": "grpo", "models": ["actor", "reference"], "samples_per_prompt": 8, "mini_batches": 2},
        "workload": {"prompts_per_step": 32, "prompt_length": 256, "response_length": {"mean": 512, "max": 4096}},
        "cluster": {"gpu": "H100", "nodes": gpus // 8, "gpus_per_node": 8}})


def _trace(steps=10):
    return trace_from_dict({"source": "test", "steps": steps,
                            "response_length": {"sigma": 1.0, "points": [{"step": 0, "mean": 800, "max": 8192}]},
                            "length_correlation": {"siblings": 0.5, "source": "test"}})


def test_the_simulator_draws_groups_with_the_traces_correlation():
    backend = SimBackend(_grpo(), _trace())
    lengths, z = backend.draw_step(3)
    assert len(lengths) == 256 and len(z) == 32
    assert np.array_equal(lengths, backend.draw_lengths(3))  # one draw per (seed, step)


def test_rollpacker_like_defers_whole_groups_and_trains_on_policy():
    record = simulate(_grpo(), _trace(12), "rollpacker-like", seed=0, steps=12)
    verl = simulate(_grpo(), _trace(12), "verl-like", seed=0, steps=12)
    assert record.summary()["policy_lag_max"] == 0
    # short rounds train the P groups that ended first; long rounds regenerate the deferred prompts
    tokens = [s["tokens"] for s in record.steps]
    assert min(tokens) < min(s["tokens"] for s in verl.steps) and len(record.steps) == 12
    long_rounds = [s for s in record.steps if s["response_mean"] > 1.3 * np.mean([v["response_mean"] for v in
                                                                                 verl.steps])]
    assert long_rounds, "a long round of deferred (long) prompts ran"
    assert math.isfinite(record.summary()["tokens_per_s"])


def test_a_short_round_with_speculation_stops_when_its_groups_end_under_speculation():
    """Both levers at once: the short round's sequences decode speculatively, and the round stops once its
    groups have ended at their speculated finishes (not at the over-launched batch's end)."""
    from dataclasses import replace

    from nereus.control.tail_policy import speculation_decision
    from nereus.cost.hardware import Hardware
    from nereus.planner.search import search
    from nereus.spec.generation import Continue
    from nereus.spec.levers import GenerationLevers, Speculation, TailBatching

    class AtStart:
        def during_generation(self, status):
            return speculation_decision(status.levers) or Continue()

    job = _grpo()
    plan = search(Hardware(job.cluster), job).plan
    spec, tail = Speculation("suffix", 4, 256), TailBatching(2.0)

    def generation_s(levers: GenerationLevers) -> float:
        m = SimBackend(job, _trace(4)).run_step(replace(plan, levers=levers), 0, AtStart())
        return m.phase_times_s["generation"]

    both = generation_s(GenerationLevers(speculation=spec, tail_batching=tail))
    assert both < generation_s(GenerationLevers(tail_batching=tail))  # the same round, faster to its stop
    assert both < generation_s(GenerationLevers(speculation=spec))  # it stops before the batch's longest
