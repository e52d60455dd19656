"""Overlapped stages (run.overlap) and the continuous-batching rollout (run.rollout.slots) in the RL step:
the overlapped step issues every inference stage, then both models' optimizer steps, at once, and must
give the very numbers of the sequential step — log-probs, values, rewards and every non-timing metric;
each step reports per-worker busy and idle time."""

from __future__ import annotations

import json
import math

import pytest
import torch

from nereus.run.job import RLJob
from nereus.run.training import StepTraining
from nereus.spec.errors import SpecError
from nereus.spec.overrides import parse_override
from tests.run.jobs import run_recording_infer, tiny_job

TIMING = ("timing_s/", "perf/throughput", "perf/time_per_step", "perf/idle_fraction/", "nereus/snapshot_s")


def _check_worker_metrics(rows: list[dict], workers: int) -> None:
    for r in rows:
        for w in range(workers):
            frac = r[f"perf/idle_fraction/worker_{w}"]
            assert 0.0 <= frac <= 1.0
            for kind in ("generate", "infer", "train", "sync", "idle"):
                assert math.isfinite(r[f"timing_s/worker_{w}/{kind}"]) and r[f"timing_s/worker_{w}/{kind}"] >= 0
        # the generation layout runs on workers 0 and 1 only; the actor's inference layout on 2 and 3
        assert r["timing_s/worker_0/generate"] > 0 and r["timing_s/worker_2/generate"] == 0
        assert r["timing_s/worker_2/infer"] > 0


def _same(a: tuple, b: tuple) -> None:
    (rows_a, inf_a), (rows_b, inf_b) = a, b
    assert len(rows_a) == len(rows_b) and len(inf_a) == len(inf_b) > 0
    for x, y in zip(inf_a, inf_b, strict=True):
        assert set(x) == set(y)
        for k in set(x) - {"early"}:  # old/ref log-probs, entropy, values, rule and reward-model scores: bit-identical
            assert torch.equal(x[k], y[k]), k
    for ra, rb in zip(rows_a, rows_b, strict=True):
        keys = {k for k in ra if not k.startswith(TIMING)}
        assert keys == {k for k in rb if not k.startswith(TIMING)}
        for k in keys:
            assert ra[k] == rb[k], (ra["step"], k)


@pytest.mark.distributed
def test_overlapped_ppo_step_equals_sequential(ray_runtime, tmp_path, monkeypatch):
    runs = {}
    for overlap in (False, True):
        out = tmp_path / f"overlap_{overlap}"
        job = tiny_job("ppo", str(out), steps=2, overlap=overlap)
        runs[overlap] = run_recording_infer(job, ray_runtime, out, monkeypatch)
    _same(runs[False], runs[True])
    assert {"values", "ref_logp", "rm", "rule"} <= set(runs[True][1][0])
    for rows, _ in runs.values():
        _check_worker_metrics(rows, 4)


@pytest.mark.distributed
def test_early_inference_with_continuous_batching(ray_runtime, tmp_path, monkeypatch):
    """GRPO generating with 2 slots per replica, rollouts padded to the longest possible response: the
    overlapped step starts the actor's old log-probs (workers 2, 3: no generation) on the first finished
    generation replica's rows while the other replica still generates, and equals the sequential step.
    The sampling-time log-probs agree with the actor's inference layout."""
    runs = {}
    for overlap in (False, True):
        out = tmp_path / f"slots_{overlap}"
        job = tiny_job("grpo", str(out), steps=2, overlap=overlap, rollout={"slots": 2, "pad_to_max": True})
        assert job.run.rollout_slots == 2 and job.run.rollout_pad_to_max
        runs[overlap] = run_recording_infer(job, ray_runtime, out, monkeypatch)
    _same(runs[False], runs[True])
    # the engine ran: its per-sequence streams sample other tokens than the fixed batch's one stream
    fixed = run_recording_infer(tiny_job("grpo", str(tmp_path / "fixed"), steps=1, rollout={"pad_to_max": True}),
                                ray_runtime, tmp_path / "fixed", monkeypatch)
    assert not torch.equal(fixed[1][0]["tokens"], runs[False][1][0]["tokens"])
    for inf in runs[True][1]:
        # 8 rows, 4 per generation replica; the reference (pp=2 on workers 1, 0) waits for both replicas
        assert len(inf["early"]["old_log_prob"]) == 1 and inf["early"]["old_log_prob"][0] in (0, 4)
        assert inf["early"]["ref"] == []
    assert all(inf["early"] == {} for inf in runs[False][1])
    for rows, _ in runs.values():
        assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in rows)
        _check_worker_metrics(rows, 4)


def test_keys_default_off_and_bad_values_name_the_key(tmp_path):
    job = tiny_job("grpo", str(tmp_path))
    assert job.run.rollout_slots == 0 and job.run.overlap is False
    with pytest.raises(SpecError, match=r"run\.rollout\.slots"):
        tiny_job("grpo", str(tmp_path), rollout={"slots": -1})
    with pytest.raises(SpecError, match=r"run\.rollout\.max_num_seq"):
        tiny_job("grpo", str(tmp_path), rollout={"max_num_seq": 4})
    with pytest.raises(SpecError, match=r"run\.overlap"):
        tiny_job("grpo", str(tmp_path), overlap="yes")
    assert parse_override("actor_rollout_ref.rollout.max_num_seqs=8") == ("run.rollout.slots", 8, False)  # verl's key


@pytest.mark.distributed
def test_overlapped_run_recovers_from_a_worker_lost_mid_step(ray_runtime, tmp_path, monkeypatch):
    """Worker 1 is SIGKILLed in the critic's first optimizer step while the actor's steps are already
    queued behind it (run.overlap issues them together): the run recovers on the three survivors from the
    step's snapshot, redoes the step and finishes."""
    from nereus.runtime.comm.faults import FaultPlan

    real = StepTraining.submit_update
    armed = []

    def submit_losing_a_worker(self, model, batch, loss_fn, lr, step):
        if step == 1 and not armed:
            armed.append(model)
            self.calls.rt.inject(FaultPlan.kill(1, "train_step"))  # SIGKILL after its backward pass
        return real(self, model, batch, loss_fn, lr, step)

    monkeypatch.setattr(StepTraining, "submit_update", submit_losing_a_worker)
    rl = RLJob(tiny_job("ppo", str(tmp_path / "run"), steps=3, overlap=True), runtime=ray_runtime, quiet=True)
    try:
        summary = rl.execute()
    finally:
        rl.release()
        ray_runtime.resize(4)  # the session's runtime, as other tests expect it
    assert armed == ["critic"]
    [rec] = summary["recoveries"]
    assert rec["lost"] == [1] and rec["workers"] == 3 and rec["resume_step"] == 1
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["nereus/recovery_s"] > 0
