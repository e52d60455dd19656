"""`nereus run` under the controller (run.adapt) on the Ray workers: `nereus scale` asks a running job to
shrink and to grow; it changes its worker count within two steps, moving every model's weights and Adam
state live, and training goes on. The run writes the decision log, the per-step `nereus/*` metrics and a
run record that `nereus report` renders."""

from __future__ import annotations

import json

import pytest
import yaml

from nereus.cli import main
from nereus.run.driver import RLStep
from nereus.spec.job import load_job
from tests.conftest import EXAMPLES

pytestmark = pytest.mark.distributed
STEPS = 7
REQUESTS = {1: 1, 4: 2}  # after step k (0-based), `nereus scale N` asks for N workers


def _job(tmp_path) -> str:
    spec = yaml.safe_load((EXAMPLES / "ppo_tiny.yaml").read_text())
    spec["run"].update(steps=STEPS, eval_every=STEPS, warmstart={"actor_steps": 20, "reward_steps": 20},
                       data={"train_size": 200, "val_size": 16}, checkpoint={"dir": str(tmp_path / "run")})
    # Decisions on the profile's predictions, never on measured times: the moves are the same on an idle
    # and on a loaded machine (calibration itself is tested against given times in tests/cost/test_calibration.py)
    spec["run"]["adapt"] = {"availability": [{"step": 0, "workers": 2}], "cooldown": 0, "horizon": 20,
                            "calibrate": False}
    spec["workload"]["prompts_per_step"] = 8
    spec["run"].pop("rollout", None)  # the demo's mid-step moves: tests/run/test_midstep.py
    spec["cluster"]["profile"] = str(EXAMPLES / spec["cluster"]["profile"])  # relative to the example
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def test_scale_moves_a_running_job_live(ray_runtime, tmp_path, monkeypatch, capsys):
    from nereus.run.job import RLJob

    out = tmp_path / "run"
    real_step = RLStep.run_step  # what the runtime backend calls for each step

    def step_then_request(self, step, policy=None, levers=None):
        answer = real_step(self, step, policy, levers)
        if step in REQUESTS:  # what a user's `nereus scale N --dir RUN` does while the job runs
            assert main(["scale", str(REQUESTS[step]), "--dir", str(out)]) == 0
        return answer

    monkeypatch.setattr(RLStep, "run_step", step_then_request)
    rl = RLJob(load_job(_job(tmp_path)), runtime=ray_runtime, quiet=True)
    try:
        summary = rl.execute()
    finally:
        rl.release()
        ray_runtime.resize(4)  # the session's runtime, as other tests expect it
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    workers = [r["nereus/workers"] for r in rows]
    assert workers[3] == 1.0  # asked after the 2nd step: on one worker from the 4th on (within two steps)
    assert workers[-1] == 2.0
    moved = [r for r in rows if r["nereus/transition_s"] > 0]
    assert len(moved) == 2, [r["nereus/plan"] for r in rows]  # the shrink and the grow, nothing else
    assert all("actor/training" in r["nereus/plan"] for r in rows)
    assert all(r[k] > 0 for r in rows for k in r if k.startswith("nereus/predicted_s/"))
    decisions = [json.loads(line) for line in (out / "decisions.jsonl").read_text().splitlines()]
    actions = [(d.get("step"), d["action"]) for d in decisions]
    # shrinking off a lost worker is forced; growing back is admitted because the predicted gain beats
    # the predicted transition cost; every other step keeps its plan
    assert (1, "forced") in actions and (4, "transition") in actions, actions
    assert {a for _, a in actions} == {"forced", "transition", "keep"}, actions
    assert summary["adaptation"]["transitions"] == len(moved)
    assert summary["final_accuracy"] is not None
    assert main(["report", str(out / "run_record.json"), "--out", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report" / "report.md").exists()
    state = json.loads((out / f"step_{STEPS}" / "state.json").read_text())
    assert "plan" in state  # a resumed run starts on the plan in force, whose ranks hold the optimizer files

    # resume for two more steps: the plan in force at the checkpoint, its Adam state restored per rank
    monkeypatch.setattr(RLStep, "run_step", real_step)
    job = load_job(_job(tmp_path))
    job = job.__class__(**{**job.__dict__, "run": job.run.__class__(**{**job.run.__dict__, "steps": STEPS + 2})})
    rl = RLJob(job, runtime=ray_runtime, quiet=True)
    try:
        rl.execute(resume=True)
    finally:
        rl.release()
        ray_runtime.resize(4)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 3))
