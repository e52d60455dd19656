"""Smoke test of benchmarks/verify_cost_gpu.py: the tiny shape measured on CPU (``--device cpu --small``) is
written as a readable table, and ``--predict`` re-prints the stored H200 run beside the cost model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.rayless]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "benchmarks/verify_cost_gpu.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_small_run_on_cpu_writes_every_configuration(tmp_path: Path) -> None:
    out = tmp_path / "verify.csv"
    proc = run("--device", "cpu", "--small", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = out.read_text().splitlines()
    assert lines[0].startswith("# benchmarks/verify_cost_gpu.py on cpu")
    rows = [ln.split(",") for ln in lines[2:]]
    assert [(r[1], r[2]) for r in rows] == [("1", "1"), ("1", "3"), ("4", "1"), ("4", "3")]
    assert all(float(r[4]) > 0 for r in rows)


def test_predict_reprints_the_stored_h200_run() -> None:
    proc = run("--predict", "nereus/cost/verify_h200_measured.csv")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "verification in plain steps: mean |error|" in proc.stdout
    assert proc.stdout.count("llama3-8b") >= 100
