"""`nereus report` on a real run's record (what `nereus run` writes): learning curves from the metrics.jsonl
beside it, the held-out accuracy from the warm-start (only where one ran), and the run time in units that fit.
The run folder is built here, as `nereus run` lays it out, without starting Ray."""

from __future__ import annotations

import json
from pathlib import Path

from nereus.cli import main
from nereus.sim.report import write_report

STEPS = 40


def run_folder(tmp_path: Path, state: dict | None) -> Path:
    """A run folder: run_record.json (40 steps of 2 s), metrics.jsonl (steps counted from 1, held-out accuracy
    every 10 steps) and, with ``state``, the latest checkpoint's state.json."""
    folder = tmp_path / "run"
    folder.mkdir()
    steps = [{"step": i, "step_time_s": 2.0, "phases": {"generation": 0.5, "inference": 0.5, "training": 1.0,
                                                         "weight_sync": 0.0},
              "gpus": 2, "response_mean": 5.0, "response_max": 7.0, "tokens": 2000.0, "transition_s": 0.0,
              "lost_s": 0.0, "strategy": "colocated", "policy_lag": [1.0]} for i in range(STEPS)]
    summary = {"policy": "nereus", "steps": STEPS, "mean_step_s": 2.0, "run_s": 2.0 * STEPS, "transitions": 0,
               "transition_s": 0.0, "transition_share": 0.0, "tokens_per_s": 1000.0, "tokens_per_gpu_s": 500.0,
               "failures": 0, "lost_s": 0.0, "controller_overhead_s_per_step": 0.003,
               "controller_overhead_share": 0.0015, "wall_s": 84.0}
    (folder / "run_record.json").write_text(json.dumps(
        {"policy": "nereus", "job": "ppo-tiny", "trace": "runtime", "seed": 0, "summary": summary, "steps": steps,
         "decisions": [], "plans": [], "generation_decisions": []}))
    lines = []
    for i in range(1, STEPS + 1):
        m = {"step": i, "critic/score/mean": 0.3 + i / 100, "reward/rule/mean": 0.25 + i / 100,
             "actor/ppo_kl": 0.001 * i, "actor/reward_kl_penalty": 0.002, "response_length/mean": 5.0,
             "response_length/max": 7.0, "timing_s/step": 2.0}
        if i % 10 == 0:
            m["val/accuracy"] = 0.6 + i / 200
        lines.append(json.dumps(m))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\nnot a metrics line\n")
    if state is not None:
        (folder / f"step_{STEPS}").mkdir()
        (folder / f"step_{STEPS}" / "state.json").write_text(json.dumps({**state, "step": STEPS}))
        (folder / "latest").write_text(str(STEPS))
    return folder


def test_a_real_run_is_drawn_with_its_learning_curves_and_run_time(tmp_path, capsys):
    folder = run_folder(tmp_path, {"warmstart_accuracy": 0.57, "warmstart/actor_steps": 160.0})
    assert main(["report", str(folder / "run_record.json"), "--out", str(tmp_path / "rep")]) == 0
    printed = capsys.readouterr().out
    for name in ("reward", "accuracy", "kl", "response_length", "step_latency", "timeline"):
        assert f"{name}: " in printed and next((tmp_path / "rep").glob(f"{name}.*")).stat().st_size > 1000
    assert "| 80 s |" in printed and "0.00" not in printed.split("\n")[4]  # 40 steps of 2 s: "0.02 h" before
    assert "57.0% after the warm-start -> 80.0% at step 40 (+23.0 points)" in printed
    assert "84 s wall-clock for the steps" in printed
    text = (tmp_path / "rep" / "report.md").read_text()
    assert "![kl](kl.png)" in text and "![accuracy](accuracy.png)" in text


def test_no_warm_start_line_without_a_warm_start(tmp_path):
    pretrained = run_folder(tmp_path, {"warmstart_accuracy": 0.0})  # a pretrained model: no warm-start ran
    text = write_report([str(pretrained / "run_record.json")], tmp_path / "a")["markdown"].read_text()
    assert "warm-start" not in text and "0.0% at the start -> 80.0% at step 40" in text


def test_without_a_checkpoint_the_first_evaluation_is_the_start(tmp_path):
    folder = run_folder(tmp_path, None)
    outputs = write_report([str(folder / "run_record.json")], tmp_path / "b")
    text = outputs["markdown"].read_text()
    assert "warm-start" not in text and "65.0% at step 10 -> 80.0% at step 40 (+15.0 points)" in text
    assert {"reward", "accuracy", "kl", "response_length"} <= set(outputs)


def test_dynamic_sampling_shows_its_keep_rate_per_step(tmp_path):
    """run.filter_groups: keep_rate.png and a line with the keep-rate from the first step to the last."""
    folder = run_folder(tmp_path, None)
    path = folder / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()[:STEPS]]
    for m in rows:  # the keep-rate falls as the policy learns: 50% -> 11%, 2 -> 9 batches
        m["train/num_gen_batches"] = 2.0 if m["step"] < STEPS else 9.0
        m["train/filter_groups_keep_rate"] = 0.5 if m["step"] < STEPS else 1 / 9
    path.write_text("\n".join(json.dumps(m) for m in rows) + "\n")
    outputs = write_report([str(folder / "run_record.json")], tmp_path / "c")
    text = outputs["markdown"].read_text()
    assert "keep_rate" in outputs and "![keep_rate](keep_rate.png)" in text
    assert ("keep-rate 50.0% at step 1 -> 11.1% at step 40 (mean 49.0%), 2.2 generation batches a step "
            "(at most 9)") in text
    (tmp_path / "plain").mkdir()
    plain = write_report([str(run_folder(tmp_path / "plain", None) / "run_record.json")], tmp_path / "d")
    assert "keep_rate" not in plain and "keep-rate" not in plain["markdown"].read_text()
