"""Smoke test of benchmarks/long_tail_runtime.py at tiny size: one mode of each kind of run the harness
drives and compares runs (the fixed-batch step, the engine with and without mid-step moves, asynchrony on
other layouts, the levers together at policy lag 1): their figures, per-step wall times, idle fractions,
accuracies and the levers' policy lag present and in range, none failed; the table, the JSON and the PNG
are written. Every other mode differs from these only in its job's keys, which the spec accepts (checked
without a run); each runs for real in its own runtime test (tests/run; vLLM's in test_vllm_job.py). No
timing is asserted: the figures are reported, never checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# the quick run starts its own Ray instance in the benchmark's process, none of the session's: it may run beside
# the Ray group (tests/conftest.py)
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.beside_ray]


SMOKE_MODES = ("static", "intra", "intra+midstep", "async", "levers")


def test_every_modes_job_is_accepted_by_the_spec(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import long_tail_runtime as bench
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    args = bench.parse(["--quick"])
    jobs, skipped = bench.mode_jobs(bench.base_spec(tmp_path, args), list(bench.MODES))
    from nereus.spec.engines import ENGINE_TRAITS, installed_distribution

    # the one mode that needs an optional package
    refused = [] if installed_distribution(ENGINE_TRAITS["vllm"]) is not None else ["vllm"]
    assert list(skipped) == refused and list(jobs) == [m for m in bench.MODES if m not in refused]
    assert set(SMOKE_MODES) <= set(bench.MODES)
    # the steadier accuracy: the evaluations after the run's middle (the warm-start's, at step 0, never)
    curve = [[0, 0.1], [10, 0.5], [20, 0.7], [30, 0.8], [40, 0.9]]
    assert bench.late_accuracy(curve) == pytest.approx(0.85)  # steps 30 and 40
    assert bench.late_accuracy([[0, 0.1], [3, 0.4]]) == 0.4


def test_quick_run_writes_table_json_and_plot(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "benchmarks/long_tail_runtime.py", "--quick", "--out", str(tmp_path),
                           "--modes", ",".join(SMOKE_MODES)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "long_tail_runtime.json").read_text())
    assert (tmp_path / "long_tail_runtime.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    modes = SMOKE_MODES
    assert not data["skipped"], data["skipped"]
    assert not data["failed"], data["failed"]
    assert list(data["figures"]) == list(modes)
    steps = data["config"]["steps"]
    for mode, f in data["figures"].items():
        (rnd,) = data["runs"][mode]  # --quick: one round
        assert len(rnd["metrics"]) == len(rnd["wall_s"]) == steps, mode
        assert [r["step"] for r in rnd["metrics"]] == list(range(1, steps + 1)), mode
        assert all(w > 0 for w in rnd["wall_s"]), mode
        assert f["step_s"] > 0 and f["gen_s"] > 0, mode
        assert set(f["idle"]) == {"worker_0", "worker_1"} and all(0 <= v <= 1 for v in f["idle"].values()), mode
        assert 0 <= f["warmstart_accuracy"] <= 1 and 0 <= f["final_accuracy"] <= 1, mode
        assert rnd["accuracy_curve"][0] == [0, rnd["warmstart_accuracy"]], mode
        assert rnd["accuracy_curve"][-1] == [steps, rnd["final_accuracy"]], mode
        assert f["vs_static"] > 0 and isinstance(f["goal_met"], bool), mode
        assert f["late_accuracy"] == f["final_accuracy"], mode  # no --eval-every: the last evaluation alone
        assert 0 <= f["extra"]["batch/solve_partial"] <= 1, mode
        if mode == "intra+midstep":
            assert f["vs_intra"] > 0 and "midstep/moves" in f["extra"]
        if mode == "async":
            assert "async/staleness/mean" in f["extra"]
        if mode in ("tail", "partial", "levers"):
            assert 0 <= f["extra"]["rollout/policy_lag_mean"] <= (0 if mode == "tail" else 1), mode
        assert mode in proc.stdout
    # every mode started from the same warm-started actor: one warm-start, the very same initial actor file,
    # the same accuracy before RL (async generates on other layouts, whose padding may round differently)
    assert data["warmstarts"] == 1
    assert len({data["runs"][m][0]["init_actor_sha256"] for m in modes}) == 1
    assert len({f["warmstart_accuracy"] for m, f in data["figures"].items() if m != "async"}) == 1
    assert data["figures"]["static"]["vs_static"] == 1.0
    assert "goal: >= 33% lower mean step time" in proc.stdout and data["table"] in proc.stdout
