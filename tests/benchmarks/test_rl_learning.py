"""benchmarks/rl_learning.py without running a job: seed lists, and ``--report`` joining the ``--json`` files
of a sweep run in parts into one table whose exit status is the acceptance (every run >= 75% and above its
warm-start). The runs themselves are `nereus run` of the examples (tests/run covers those)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import rl_learning  # noqa: E402


def run_figures(seed: int, warm: float, final: float) -> dict:
    return {"example": "grpo", "seed": seed, "wall_s": 100.0 + seed, "warm": warm, "final": final, "steps": 300,
            "step_s": 0.3, "entropy_first": 0.4, "entropy_last": 0.05, "ppo_kl_last_max": 0.02, "ratio_dev_max": 1.5}


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text(json.dumps({"overrides": [], "runs": {"grpo": rows}}))
    return path


def report(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "benchmarks/rl_learning.py", "--report", *map(str, paths)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_seed_lists() -> None:
    assert rl_learning.seed_list("0-4") == [0, 1, 2, 3, 4]
    assert rl_learning.seed_list("0,2,5") == [0, 2, 5]
    assert rl_learning.seed_list("0-2,7") == [0, 1, 2, 7]


def test_report_joins_parts_in_seed_order_and_passes_when_every_run_does(tmp_path: Path) -> None:
    late = write(tmp_path / "b.json", [run_figures(3, 0.6, 0.9), run_figures(4, 0.7, 0.95)])
    early = write(tmp_path / "a.json", [run_figures(0, 0.57, 0.84), run_figures(1, 0.745, 0.99)])
    proc = report(late, early)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("grpo ") and "ok" in line]
    assert rows == ["0", "1", "3", "4"]
    assert "mean 92.0%, worst 84.0% (seed 0)" in proc.stdout
    assert "4/4 pass" in proc.stdout


def test_report_fails_a_run_below_the_floor_or_its_warm_start(tmp_path: Path) -> None:
    below = write(tmp_path / "below.json", [run_figures(0, 0.5, 0.74), run_figures(1, 0.5, 0.9)])
    proc = report(below)
    assert proc.returncode == 1 and "1/2 pass" in proc.stdout
    worse = write(tmp_path / "worse.json", [run_figures(0, 0.9, 0.85)])  # above 75% yet below its warm-start
    proc = report(worse)
    assert proc.returncode == 1 and "FAIL" in proc.stdout
