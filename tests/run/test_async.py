"""run.async: generation of step k+1 overlaps training of step k (nereus.run.asyncmode), and the off-policy
correction of its stale rollouts (nereus.rl.offpolicy: decoupled PPO with truncated or masked importance
weights). The pure functions are checked against PPO's loss and a hand-written gradient; the mode runs on
the session's Ray workers with generation on workers 0-1 and everything else on 2-3."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from nereus.rl.core import clipped_policy_loss
from nereus.rl.offpolicy import correction_metrics, decoupled_policy_loss, raw_weights, rollout_is_weights
from nereus.run.asyncmode import AUTO_WARMUP, AsyncRollouts, predict
from nereus.spec.errors import SpecError
from tests.run.jobs import tiny_job

TIMING = ("timing_s/", "perf/throughput", "perf/time_per_step", "perf/idle_fraction/", "nereus/snapshot_s")
DISJOINT = {  # generation alone on workers 0-1; the actor's inference and training and the reference on 2-3
    "actor/generation": {"layout": "dp=2", "ranks": [0, 1]},
    "actor/inference": {"layout": "dp=2,micro_batch_size=4", "ranks": [2, 3]},
    "reference/inference": {"layout": "dp=2,micro_batch_size=4", "ranks": [2, 3]},
    "actor/training": {"layout": "dp=2,micro_batch_size=1", "ranks": [2, 3]},
}


def _frames(seed: int = 0, b: int = 4, r: int = 6, spread: float = 0.8) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    behav = -torch.rand(b, r, generator=g) * 3
    prox = behav + (torch.rand(b, r, generator=g) - 0.5) * 2 * spread
    logp = prox + (torch.rand(b, r, generator=g) - 0.5) * 0.6
    adv = torch.randn(b, r, generator=g)
    mask = torch.ones(b, r)
    mask[0, 4:] = 0
    mask[2, 2:] = 0
    return logp, prox, behav, adv, mask


# ----- the pure functions -------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_behaviour_equal_to_proximal_gives_ppo_loss_exactly(level, mode):
    logp, prox, _, adv, mask = _frames()
    w, keep = rollout_is_weights(prox, prox.clone(), mask, level, 2.0, mode)
    assert torch.equal(w, mask) and torch.equal(keep, mask)
    got = decoupled_policy_loss(logp, prox, adv, w, 0.2, 0.28, 3.0)
    want = clipped_policy_loss(logp, prox, adv, 0.2, 0.28, 3.0)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a * mask, b * mask)


def test_weights_are_truncated_or_masked_at_the_threshold():
    _, prox, behav, _, mask = _frames(spread=2.0)
    raw = torch.exp(prox - behav)
    assert float((raw * mask).max()) > 2.0 and float((raw * mask + (1 - mask) * 9).min()) < 1.0  # both sides
    w, keep = rollout_is_weights(prox, behav, mask, "token", 2.0, "truncate")
    assert float(w.max()) <= 2.0 and torch.equal(keep, mask)
    assert torch.allclose(w, torch.minimum(raw, torch.tensor(2.0)) * mask)
    w, keep = rollout_is_weights(prox, behav, mask, "token", 2.0, "mask")  # AReaL: dropped, not clamped
    assert torch.equal(keep, mask * (raw <= 2.0).float())
    assert torch.allclose(w, raw * keep) and 0 < float(keep.sum()) < float(mask.sum())
    # sequence level: the product of the sequence's token ratios on each of its tokens
    w, _ = rollout_is_weights(prox, behav, mask, "sequence", 1e9, "truncate")
    seq = torch.exp(((prox - behav) * mask).sum(-1))
    assert torch.allclose(w, seq[:, None] * mask, rtol=1e-5)
    with pytest.raises(ValueError, match="threshold"):
        rollout_is_weights(prox, behav, mask, "token", 1.0)


def test_gradient_matches_the_hand_formula():
    """d loss / d logp per token = −w·A·r where the surrogate is not clipped, 0 where it is (the ratio
    past 1+ε_high with A > 0, below 1−ε_low with A < 0, or past the dual-clip c with A < 0)."""
    logp, prox, behav, adv, mask = _frames(seed=1, spread=1.0)
    logp = (prox + torch.tensor([-0.5, -0.1, 0.05, 0.15, 0.4, 1.3]).expand_as(prox)).requires_grad_(True)
    w, _ = rollout_is_weights(prox, behav, mask, "token", 2.0, "truncate")
    loss, _, _ = decoupled_policy_loss(logp, prox, adv, w, 0.2, 0.28, 3.0)
    (loss * mask).sum().backward()
    r = torch.exp(logp.detach() - prox)
    active = torch.where(adv > 0, r < 1.28, (r > 0.8) & (r < 3.0))
    want = torch.where(active, -w * adv * r, torch.zeros_like(r)) * mask
    assert torch.allclose(logp.grad, want, atol=1e-6)
    assert bool(active.any()) and bool((~active & mask.bool()).any())  # both cases occur


def test_correction_metrics():
    _, prox, behav, _, mask = _frames(spread=2.0)
    w, keep = rollout_is_weights(prox, prox.clone(), mask)
    m = correction_metrics(prox, prox.clone(), mask, w, keep, 2.0)
    assert m["rollout_corr/rollout_is_mean"] == 1.0 and m["rollout_corr/rollout_is_eff_sample_size"] == 1.0
    assert m["rollout_corr/kl"] == 0.0 and m["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    w, keep = rollout_is_weights(prox, behav, mask, "token", 2.0, "mask")
    m = correction_metrics(prox, behav, mask, w, keep, 2.0)
    high = float(((raw_weights(prox, behav, mask) > 2.0).float() * mask).sum() / mask.sum())
    assert high > 0 and m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(high)
    assert m["rollout_corr/rollout_is_max"] <= 2.0 and 0 < m["rollout_corr/rollout_is_eff_sample_size"] < 1


# ----- the spec and the auto rule ----------------------------------------------------------------------
@pytest.mark.parametrize(("value", "key"), [
    ({"enabled": "maybe"}, r"run\.async\.enabled"), ({"enabled": 1}, r"run\.async\.enabled"),
    ({"staleness": 2}, r"run\.async\.staleness"), ({"staleness": 0}, r"run\.async\.staleness"),
    ({"rollout_is_threshold": 0.5}, r"run\.async\.rollout_is_threshold"),
    ({"rollout_is": "seq"}, r"run\.async\.rollout_is"), ({"rollout_is_mode": "clip"}, r"run\.async\.rollout_is_mode"),
    ({"stalenes": 1}, r"run\.async\.stalenes.*did you mean 'staleness'"),
])
def test_bad_async_values_name_the_key(tmp_path, value, key):
    with pytest.raises(SpecError, match=key):
        tiny_job("grpo", str(tmp_path), **{"async": value})


def test_async_defaults_off_and_refuses_adapt(tmp_path):
    assert not tiny_job("grpo", str(tmp_path)).run.async_mode.on
    spec = tiny_job("grpo", str(tmp_path), **{"async": {"enabled": True}}).run.async_mode
    assert spec.on and (spec.staleness, spec.rollout_is, spec.rollout_is_threshold) == (1, "token", 2.0)
    assert tiny_job("grpo", str(tmp_path), **{"async": {"enabled": "auto"}}).run.async_mode.enabled == "auto"
    with pytest.raises(SpecError, match=r"run\.async\.enabled.*run\.adapt"):
        tiny_job("grpo", str(tmp_path), layouts={}, adapt={}, **{"async": {"enabled": True}})


def _mode(placed: list[tuple[str, str, list[int]]], enabled: str = "auto") -> AsyncRollouts:
    run = SimpleNamespace(async_mode=SimpleNamespace(enabled=enabled, staleness=1))
    keys = SimpleNamespace(placed=[SimpleNamespace(model=m, stage=s, ranks=r) for m, s, r in placed])
    return AsyncRollouts(run, keys, generation=None, calls=None, clock=None)


def test_auto_switches_on_only_when_the_prediction_gains():
    step = {"timing_s/step": 1.0, "timing_s/gen": 0.5, "timing_s/update_weights": 0.1}
    assert predict([step], shared=False) == pytest.approx((1.0, 0.6))  # max(0.5, 0.4) + 0.1
    assert predict([step], shared=True) == (1.0, 1.0)
    disjoint = [("actor", "generation", [0, 1]), ("actor", "training", [2, 3]), ("actor", "inference", [2, 3])]
    shared = [("actor", "generation", [0, 1]), ("actor", "training", [1, 2])]
    for placed, on in ((disjoint, True), (shared, False)):
        a = _mode(placed)
        lines = [dict(step) for _ in range(AUTO_WARMUP)]
        for k, m in enumerate(lines):
            assert not a.enabled
            a.observe(k, m)
        assert a.enabled is on and lines[-1]["async/decision/enabled"] == float(on)
        assert all(m["async/enabled"] == 0.0 for m in lines)
    tiny_gen = [dict(step, **{"timing_s/gen": 0.02}) for _ in range(AUTO_WARMUP)]  # nothing worth overlapping
    a = _mode(disjoint)
    for k, m in enumerate(tiny_gen):
        a.observe(k, m)
    assert not a.enabled


# ----- the mode on Ray workers -------------------------------------------------------------------------
def _run(job, runtime, out, resume: bool = False) -> tuple[list[dict], list]:
    from nereus.run.job import RLJob

    rl = RLJob(job, runtime=runtime, out_dir=out, quiet=True)
    try:
        rl.execute(resume=resume)
        mode = rl.backend.rl_step.asynchronous
    finally:
        rl.release()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, (mode.events if mode is not None else [])


def _job(out, steps: int, **mode: object):
    return tiny_job("grpo", str(out), steps=steps, layouts=DISJOINT, **({"async": mode} if mode else {}))


@pytest.mark.distributed
def test_async_run_runs_ahead_within_the_bound_and_resumes_like_an_uninterrupted_run(ray_runtime, tmp_path):
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    rows, events = _run(_job(straight, 4, enabled=True), ray_runtime, straight)
    # checkpoints after steps 2 and 4: step 2 is generated afresh (nothing in flight at a checkpoint)
    assert [r["async/staleness/max"] for r in rows] == [0.0, 1.0, 0.0, 1.0]
    assert all(r["async/enabled"] == 1.0 and r["async/staleness/max"] <= 1 for r in rows)
    at = {e: i for i, e in enumerate(events)}
    for k in (1, 3):  # generation of step k was issued before the training of step k-1 answered
        assert at["generation_issued", k] < at["training_answered", k - 1] < at["generation_answered", k]
    assert at["training_answered", 1] < at["generation_issued", 2]
    # the stale rollouts really came from the previous weights: their sampling log-probs differ from the
    # recomputed ones by far more than rounding; the fresh ones only by rounding
    fresh = max(rows[0]["rollout/logprob_diff_max"], rows[2]["rollout/logprob_diff_max"])
    stale = min(rows[1]["rollout/logprob_diff_max"], rows[3]["rollout/logprob_diff_max"])
    assert fresh < 1e-4 < stale
    for r in rows:
        assert r["rollout_corr/rollout_is_max"] <= 2.0 and r["rollout_corr/rollout_is_mean"] > 0
        generated = r["async/generation_ahead"] or r["async/staleness/max"] == 0  # a generation call in this step
        assert (r["timing_s/worker_0/generate"] > 0) == bool(generated) and r["timing_s/worker_2/generate"] == 0
    assert [r["async/generation_ahead"] for r in rows] == [1.0, 0.0, 1.0, 0.0]
    # stopped after the step-2 checkpoint and resumed: steps 3-4 as the uninterrupted run
    _run(_job(cut, 2, enabled=True), ray_runtime, cut)
    resumed, _ = _run(_job(cut, 4, enabled=True), ray_runtime, cut, resume=True)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for ra, rb in zip(rows, resumed, strict=True):
        for k, v in ra.items():
            if not k.startswith(TIMING):
                assert rb[k] == pytest.approx(v, rel=1e-4, abs=1e-5), (ra["step"], k)


@pytest.mark.distributed
def test_auto_before_its_decision_leaves_every_number_unchanged(ray_runtime, tmp_path):
    off, auto = tmp_path / "off", tmp_path / "auto"
    a, _ = _run(_job(off, 2), ray_runtime, off)
    b, events = _run(_job(auto, 2, enabled="auto"), ray_runtime, auto)  # 2 steps < AUTO_WARMUP: still deciding
    assert events == [] and all(r["async/enabled"] == 0.0 for r in b)
    for ra, rb in zip(a, b, strict=True):
        assert set(rb) - set(ra) == {"async/enabled"}
        for k, v in ra.items():
            if not k.startswith(TIMING):
                assert rb[k] == v, (ra["step"], k)
