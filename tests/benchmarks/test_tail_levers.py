"""Smoke test of benchmarks/tail_levers.py on one job and trace, three simulated steps: every policy and
every lever gets a row with a finite gain (no speed is asserted)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.rayless]  # no Ray: may run beside the Ray tests


def test_tail_levers_benchmark_prints_every_policy_and_lever() -> None:
    args = ["--sim", "--steps", "3", "--jobs", "grpo_7b_h100", "--traces", "long_tail_dapo"]
    proc = subprocess.run([sys.executable, "benchmarks/tail_levers.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    for policy in ("nereus", "verl-like", "fixed-oracle"):
        assert re.search(rf"^\s+{policy}\s+3\s", out, re.M), policy
    for lever in ("spec:suffix", "spec:draft_head", "tail batching", "partial rollout (lag 1)",
                  "one-step async (lag 1)", "spec + tail batching (lag 0)", "spec + partial + async (lag 1)"):
        row = re.search(rf"^\s+{re.escape(lever)}\s+([\d., ]+?)\s+([\d.]+)\s+([\d.]+) \(target", out, re.M)
        assert row, lever
        assert all(0.5 < float(g) < 10 for g in row.group(1).split(", ")), row.group(0)
