"""`nereus run` loses a worker in the middle of a step: the job re-plans onto the three
survivors, restores the step's starting state from live replicas and the host-memory snapshot, redoes the
step and finishes the run — one line per step in the metrics, a complete checkpoint at the end."""

from __future__ import annotations

import json

import pytest

from nereus.run.job import RLJob
from nereus.run.manifest import verify_manifest
from nereus.run.training import StepTraining
from nereus.runtime.comm.faults import FaultPlan
from tests.run.jobs import tiny_job

pytestmark = pytest.mark.distributed
LOSE_AT = 1  # 0-based step whose first optimizer update loses worker 1


def test_run_continues_after_losing_a_worker_mid_step(ray_runtime, tmp_path, monkeypatch):
    real_update = StepTraining.update
    armed = []

    def update_losing_a_worker(self, model, batch, loss_fn, lr, step):
        if step == LOSE_AT and not armed:
            armed.append(model)
            self.calls.rt.inject(FaultPlan.kill(1, "train_step"))  # SIGKILL after its backward pass
        return real_update(self, model, batch, loss_fn, lr, step)

    monkeypatch.setattr(StepTraining, "update", update_losing_a_worker)
    rl = RLJob(tiny_job("ppo", str(tmp_path / "run"), steps=3), runtime=ray_runtime, quiet=True)
    try:
        summary = rl.execute()
    finally:
        rl.release()
        ray_runtime.resize(4)  # the session's runtime, as other tests expect it
    assert armed == ["critic"]  # the critic updates first: the worker died in the critic's training step
    [rec] = summary["recoveries"]
    assert rec["lost"] == [1] and rec["workers"] == 3 and rec["resume_step"] == LOSE_AT
    assert rec["snapshot_only"] == ["critic"]  # its state changed in the lost step; the others were intact
    assert set(rec["live_state"]) == {"actor", "reference", "reward"}
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[LOSE_AT]["nereus/recovery_s"] > 0 and "nereus/recovery_s" not in rows[0]
    assert all(r["nereus/snapshot_s"] > 0 for r in rows)
    assert max(r for p in rl.placed for r in p.ranks) <= 2  # on the three survivors
    verify_manifest(tmp_path / "run" / "step_3")


def test_adaptive_run_replans_after_losing_a_worker(ray_runtime, tmp_path, monkeypatch):
    """Under the controller (run.adapt, 2 workers available, on the session's 4-worker runtime): worker 1 is
    SIGKILLed from outside while step 3 runs; the controller's plan for the survivors (no more than the 2
    the schedule grants; the spare ones leave) takes over from the snapshot, and the run finishes with the
    recovery in its decision log and run record."""
    import os
    import signal

    import ray
    import yaml

    from nereus.spec.job import load_job
    from tests.conftest import EXAMPLES

    spec = yaml.safe_load((EXAMPLES / "ppo_tiny.yaml").read_text())
    spec["run"].update(steps=5, eval_every=5, warmstart={"actor_steps": 20, "reward_steps": 20},
                       data={"train_size": 200, "val_size": 16}, checkpoint={"dir": str(tmp_path / "run")})
    spec["run"]["adapt"] = {"availability": [{"step": 0, "workers": 2}], "cooldown": 0, "horizon": 20}
    spec["workload"]["prompts_per_step"] = 8
    spec["run"].pop("rollout", None)  # the demo's mid-step moves: tests/run/test_midstep.py
    spec["cluster"]["profile"] = str(EXAMPLES / spec["cluster"]["profile"])
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))

    real_update = StepTraining.update
    killed = []

    def update_then_kill(self, model, batch, loss_fn, lr, step):
        if step == 2 and not killed:
            killed.append(ray.get(self.calls.rt.workers[1].pid.remote()))
            os.kill(killed[0], signal.SIGKILL)
        return real_update(self, model, batch, loss_fn, lr, step)

    monkeypatch.setattr(StepTraining, "update", update_then_kill)
    rl = RLJob(load_job(str(tmp_path / "job.yaml")), runtime=ray_runtime, quiet=True)
    try:
        summary = rl.execute()
    finally:
        rl.release()
        ray_runtime.resize(4)
    [rec] = summary["recoveries"]
    assert rec["lost"] == [1] and rec["workers"] == 3 and rec["resume_step"] == 2
    out = tmp_path / "run"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[2]["nereus/recovery_s"] > 0
    assert [r["nereus/workers"] for r in rows[2:]] == [2.0, 2.0, 2.0]
    decisions = [json.loads(line) for line in (out / "decisions.jsonl").read_text().splitlines()]
    assert any(d.get("action") == "recover" for d in decisions)
    record = json.loads((out / "run_record.json").read_text())
    assert sum(s["lost_s"] for s in record["steps"]) > 0
