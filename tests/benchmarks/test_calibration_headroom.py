"""Smoke test of benchmarks/calibration_headroom.py at its smallest size: a row per run with both mean
steps, and the summary line. No figure is asserted beyond being present and in range."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.rayless]  # no Ray: may run beside the Ray tests


def test_smallest_run_prints_fitted_and_known_mean_steps() -> None:
    args = ["--jobs", "grpo_7b_h100", "--traces", "long_tail_dapo", "--lags", "0", "1", "--seeds", "3",
            "--steps", "8"]
    proc = subprocess.run([sys.executable, "benchmarks/calibration_headroom.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("  grpo_7b_h100")]
    assert [r[2:4] for r in rows] == [["0", "3"], ["1", "3"]]
    for r in rows:
        fitted, known = float(r[4].rstrip("s")), float(r[5].rstrip("s"))
        assert fitted > 0 and known > 0 and r[6].endswith("%")
    assert "known factors against fitted, mean step over 2 runs: mean" in proc.stdout
