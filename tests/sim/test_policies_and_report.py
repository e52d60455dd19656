import json

import pytest

from nereus.cli import main
from nereus.sim.baselines import POLICIES, make_policy
from nereus.sim.report import write_report
from nereus.sim.run import simulate
from nereus.spec.trace import load_trace
from tests.conftest import EXAMPLES, ROOT
from tests.sim.test_controller import small_job, trace


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_runs_and_reports(name):
    record = simulate(small_job(32), trace(12), name, seed=1, steps=12)
    s = record.summary()
    assert s["steps"] == 12 and s["mean_step_s"] > 0 and s["tokens_per_s"] > 0


def test_baselines_have_the_shape_they_model():
    job = small_job(32)
    verl = make_policy("verl-like", job).initial_plan(32)
    assert verl.meta["strategy"] == "colocated"
    assert all(p.layout.tp == p.layout.pp == 1 and (p.layout.fsdp or p.layout.dp == 1)
               for p in verl.placements if p.model_stage.stage != "generation")
    orl = make_policy("openrlhf-like", job).initial_plan(32)
    gpu_sets = [set(p.gpus) for p in orl.placements]
    rollout = set(orl.placement("actor/generation").gpus)
    assert all(not (s & rollout) for s, p in zip(gpu_sets, orl.placements, strict=True)
               if p.model_stage.stage != "generation")
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("deepspeed-chat", job)


def test_trace_files_cite_sources_and_load():
    paths = sorted((ROOT / "traces").glob("*.yaml"))
    assert len(paths) >= 4
    for path in paths:
        t = load_trace(path)
        assert len(t.source) > 40, f"{path.name} must cite where its numbers come from"


def test_simulate_and_report_cli(tmp_path, capsys):
    t = tmp_path / "t.yaml"
    t.write_text((ROOT / "traces" / "r1_zero_growth.yaml").read_text())
    runs = []
    for policy in ("nereus", "fixed-dp"):
        out = tmp_path / f"{policy}.json"
        assert main(["simulate", str(t), "--job", str(EXAMPLES / "ppo_tiny_cpu.yaml"), "--policy", policy,
                     "--steps", "15", "--out", str(out), "--json"]) == 0
        runs.append(str(out))
    summary = json.loads(capsys.readouterr().out.split("\n}\n")[0] + "\n}")
    assert summary["summary"]["steps"] == 15
    outputs = write_report(runs, tmp_path / "rep")
    assert outputs["step_latency"].stat().st_size > 1000 and outputs["workload"].exists()
    timeline = json.loads(outputs["timeline"].read_text())
    assert {e["name"] for e in timeline["traceEvents"] if e["ph"] == "X"} >= {"generation", "training"}
    assert "| nereus |" in outputs["markdown"].read_text()
    assert main(["simulate", str(t), "--job", str(EXAMPLES / "ppo_tiny_cpu.yaml"), "--policy", "magic"]) == 2
    assert "--policy: 'magic' is not a policy" in capsys.readouterr().err


def test_failure_rates_are_drawn_per_seed_and_merged_with_explicit_failures():
    base = trace(200, failures=[{"step": 7, "gpus": 8}])
    t = base.__class__(**{**base.__dict__, "failure_rate": (50.0, 8)})
    a, b, c = t.with_sampled_failures(1), t.with_sampled_failures(1), t.with_sampled_failures(2)
    assert a.failures == b.failures != c.failures
    assert (7, 8) in a.failures and len(a.failures) > 2
    assert a.with_sampled_failures(5) is a  # drawn once


def test_checkpoint_restart_loses_more_than_live_recovery():
    from nereus.control.loop import Recovery

    job = small_job(32)
    tr = trace(40, gpus=[{"step": 0, "gpus": 32}], failures=[{"step": 25, "gpus": 8}])
    live = simulate(job, tr, "nereus", seed=2, steps=40, recovery=Recovery("live")).summary()
    restart = simulate(job, tr, "nereus", seed=2, steps=40,
                       recovery=Recovery("restart", checkpoint_every=10, restart_s=120)).summary()
    assert live["failures"] == restart["failures"] == 1
    assert restart["lost_s"] > 120 + live["lost_s"]
