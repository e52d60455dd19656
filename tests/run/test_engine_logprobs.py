"""The old log-probs from the engine (``algorithm.recompute_old_log_prob: false``): the actor's inference
stage is neither planned nor run, the step trains on the log-probs the native engine recorded while
sampling, and those are the ones the recomputing step would have used (within the bound that
``test_logprob_consistency`` holds under every layout); the spec refuses it wherever a trained token may
come from other weights or another engine's numbers."""

from __future__ import annotations

import pytest
import torch

from nereus.cost.hardware import Hardware
from nereus.planner.search import search
from nereus.spec.errors import SpecError
from nereus.spec.layout import ModelStage
from tests.run.jobs import run_recording_infer, tiny_job

ATOL = 2e-5  # engine vs inference log-probs of the same tokens (tests/run/test_logprob_consistency.py)


def test_the_actor_inference_stage_is_neither_listed_nor_priced(tmp_path):
    on, off = (tiny_job("grpo", str(tmp_path), recompute_old_log_prob=r) for r in (True, False))
    assert ModelStage("actor", "inference") in on.model_stages()
    assert off.model_stages() == [s for s in on.model_stages() if s != ModelStage("actor", "inference")]
    plans = {r: search(Hardware(j.cluster), j) for r, j in ((True, on), (False, off))}
    assert "actor/inference" not in {p.model_stage for p in plans[False].plan.placements}
    assert plans[False].estimate.phase_times["inference"] < plans[True].estimate.phase_times["inference"]


@pytest.mark.parametrize("run, key", [({"policy_lag": 1}, "run.policy_lag"),
                                      ({"async": {"enabled": True}}, "run.async.enabled")])
def test_refused_where_a_token_may_come_from_other_weights(tmp_path, run, key):
    with pytest.raises(SpecError, match=f"algorithm.recompute_old_log_prob.*{key}"):
        tiny_job("grpo", str(tmp_path), recompute_old_log_prob=False, **run)


@pytest.mark.distributed
def test_a_grpo_step_trains_on_the_engine_log_probs(ray_runtime, tmp_path, monkeypatch):
    runs = {r: run_recording_infer(tiny_job("grpo", str(tmp_path / str(r)), steps=1, recompute_old_log_prob=r),
                                   ray_runtime, tmp_path / str(r), monkeypatch, ("tokens", "gen_logp", "mask"))
            for r in (True, False)}
    ([row_on], [inf_on]), ([row_off], [inf_off]) = runs[True], runs[False]
    assert torch.equal(inf_on["tokens"], inf_off["tokens"])  # the same samples: the step's generation is alike
    assert torch.equal(inf_off["old_logp"], inf_off["gen_logp"] * inf_off["mask"])  # what the engine recorded
    torch.testing.assert_close(inf_on["old_logp"], inf_off["old_logp"], atol=ATOL, rtol=0)
    torch.testing.assert_close(inf_on["ref_logp"], inf_off["ref_logp"], atol=0, rtol=0)
    assert "timing_s/old_log_prob" in row_on and "timing_s/old_log_prob" not in row_off
    assert "training/rollout_probs_diff_max" in row_on and "training/rollout_probs_diff_max" not in row_off
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/ppo_kl"):
        assert row_off[key] == pytest.approx(row_on[key], abs=1e-4), key
