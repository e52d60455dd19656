import json
import subprocess
import sys

import pytest

from nereus.cli import main
from tests.conftest import ROOT


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_json_has_the_promised_fields(capsys, examples):
    code, out, _ = run(capsys, "plan", str(examples / "ppo_8b_h100.yaml"), "--gpus", "1024", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["feasible"] and data["step_time_s"] > 0
    assert len(data["device_peak_bytes"]) == 1024
    assert all(0 < b <= 80e9 for b in data["device_peak_bytes"])
    assert set(data["model_stages"]) >= {"actor/generation", "actor/training", "critic/training"}
    assert all("time_s" in v and "layout" in v for v in data["model_stages"].values())
    assert data["plan"]["num_gpus"] == 1024


def test_estimate_reads_the_file_plan_writes(capsys, examples, tmp_path):
    out_file = tmp_path / "plan.json"
    code, out, _ = run(capsys, "plan", str(examples / "grpo_7b_h100.yaml"), "--json", "--out", str(out_file))
    planned = json.loads(out)
    code, out, _ = run(capsys, "estimate", str(examples / "grpo_7b_h100.yaml"), "--plan", str(out_file), "--json")
    assert code == 0
    assert json.loads(out)["step_time_s"] == pytest.approx(planned["step_time_s"])


def test_a_run_job_is_planned_and_estimated_as_the_runtime_runs_it(capsys, examples, tmp_path):
    """A job with a ``run`` section is priced with the runtime's capability (padded rows where no token
    budget packs them), as ``nereus run`` plans it; the same job without the section is priced as written."""
    import yaml

    job_file = examples / "grpo_longtail_tiny.yaml"
    out_file = tmp_path / "plan.json"
    assert run(capsys, "plan", str(job_file), "--json", "--out", str(out_file))[0] == 0
    code, out, _ = run(capsys, "estimate", str(job_file), "--plan", str(out_file), "--json")
    as_run = json.loads(out)["model_stages"]["actor/training"]["time_s"]
    data = yaml.safe_load(job_file.read_text())
    del data["run"]
    planning_only = tmp_path / "job.yaml"
    planning_only.write_text(yaml.safe_dump(data))
    code, out, _ = run(capsys, "estimate", str(planning_only), "--plan", str(out_file), "--json")
    assert code == 0 and as_run > 1.5 * json.loads(out)["model_stages"]["actor/training"]["time_s"]


def test_estimate_training_job_from_a_layout(capsys, examples):
    code, out, _ = run(capsys, "estimate", str(examples / "train_gpt_1t_a100.yaml"), "--layout", "tp=8,pp=64")
    assert code == 0 and "gpt/training" in out and "TP8·PP64·DP6" in out


@pytest.mark.parametrize("argv,pattern", [
    (["plan", "examples/ppo_70b_a100_one_node.yaml"], "actor/training: no layout fits: it needs at least"),
    (["estimate", "examples/ppo_8b_h100.yaml", "--layout", "tp=2,pp=1"], "--layout: only for training-only jobs"),
    (["estimate", "examples/train_gpt_1t_a100.yaml", "--layout", "tp=8"], r"--layout.pp: required"),
    (["estimate", "examples/train_gpt_1t_a100.yaml", "--layout", "tp=8,pq=2"], "--layout.pq: unknown key"),
    (["plan", "examples/ppo_8b_h100.yaml", "--gpus", "60"], "--gpus: 60 is not a multiple of gpus_per_node"),
    (["estimate", "examples/ppo_8b_h100.yaml", "--plan", "missing.json"], "missing.json: plan file not found"),
    (["plan", "no-such-job.yaml"], "no-such-job.yaml: job file not found"),
])
def test_bad_input_is_a_one_line_error_without_traceback(capsys, monkeypatch, argv, pattern):
    monkeypatch.chdir(ROOT)
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert "Traceback" not in err
    assert pattern.replace("\\", "") in err or __import__("re").search(pattern, err)


def test_plan_file_with_a_misspelled_key(capsys, examples, tmp_path):
    bad = {"plan": {"num_gpus": 8, "placements": [
        {"model_stage": "gpt/training", "layout": {"tp": 8, "ppp": 1}, "gpus": list(range(8))}]}}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    code, _, err = run(capsys, "estimate", str(examples / "train_gpt_1t_a100.yaml"), "--plan", str(path))
    assert code == 2 and "plan.placements[0].layout.ppp: unknown key; did you mean 'pp'?" in err


def run_module(*argv: str) -> subprocess.CompletedProcess:
    """``python -m nereus ARGV`` in a child process, from the repository root."""
    return subprocess.run([sys.executable, "-m", "nereus", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_python_dash_m_nereus_runs_the_cli():
    helped = run_module("--help")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: nereus")
    assert all(cmd in helped.stdout for cmd in ("plan", "estimate", "simulate", "run"))
    planned = run_module("plan", "examples/grpo_7b_h100.yaml", "--json")
    assert planned.returncode == 0, planned.stderr
    data = json.loads(planned.stdout)
    assert data["feasible"] and data["step_time_s"] > 0


def test_python_dash_m_nereus_keeps_the_error_exit_code():
    failed = run_module("plan", "no-such-job.yaml")
    assert failed.returncode == 2
    assert "no-such-job.yaml: job file not found" in failed.stderr and "Traceback" not in failed.stderr
