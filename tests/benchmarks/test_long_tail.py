"""Smoke test of benchmarks/long_tail.py at its smallest size: every policy and lever runs a few steps,
the table, the acceptance lines and one step's Perfetto trace and PNG per policy are written. No figure
is asserted beyond being present and in range."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import long_tail  # noqa: E402


@pytest.mark.slow
@pytest.mark.rayless  # no Ray: may run beside the Ray tests
def test_smallest_run_prints_every_policy_and_writes_timelines(tmp_path: Path) -> None:
    policies = ["nereus", "nereus@lag1", "verl-like", "fixed-oracle", "spec-like", "rollpacker-like", "april-like",
                "verl-async-like"]
    args = ["--jobs", "grpo_7b_h100", "--traces", "long_tail_dapo", "--steps", "3", "--policies", *policies,
            "--timeline", str(tmp_path), "--timeline-step", "1"]
    proc = subprocess.run([sys.executable, "benchmarks/long_tail.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = proc.stdout
    for p in policies:
        assert f"\n  {p} " in out and f"timeline {tmp_path}" in out
    assert "STOPPED" not in out and "x verl-like (goal 1.6x)" in out and "vs fixed-oracle (goal <= +1%)" in out
    assert "with its work balanced" in out  # every simulated step records the GPU-seconds its work held
    for p in policies:
        stem = tmp_path / f"long_tail_dapo_{p.replace('@', '_')}_step1"
        events = json.loads(stem.with_suffix(".json").read_text())["traceEvents"]
        assert any(e["ph"] == "X" for e in events)
        assert stem.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.rayless
def test_several_seeds_end_with_each_goal_per_seed() -> None:
    args = ["--jobs", "grpo_7b_h100", "--traces", "long_tail_dapo", "--steps", "2", "--policies", "nereus",
            "verl-like", "--seeds", "0", "1"]
    proc = subprocess.run([sys.executable, "benchmarks/long_tail.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "seed 0\n" in out and "seed 1\n" in out and "across seeds 0, 1" in out
    row = next(line for line in out.splitlines() if line.startswith("  grpo_7b_h100") and "min " in line)
    ratios = [float(x) for x in row.split("nereus")[1].split("min")[0].split()]
    assert len(ratios) == 2 and all(0 < x < 10 for x in ratios) and row.endswith(("/2",))


def test_a_goal_beyond_the_balanced_bound_names_the_work_it_needs() -> None:
    """1.8x balanced against a 2.2x goal: the allowed balanced step is 100 s x 1.8 / 2.2, the run's held
    work split into generation and the rest as summarised."""
    run = {"balanced_step_s": 100.0, "balanced_tokens_per_s": 180.0, "balanced_generation_s": 60.0,
           "balanced_rest_s": 40.0}
    line = long_tail.work_needed(run, verl=100.0, target=2.2)
    assert line.startswith("2.2x needs <= 81.8 s of balanced work a step; it holds 100.0 s")
    assert "generation 60.0 s, inference+training+sync 40.0 s" in line
