"""Smoke test of benchmarks/transition_runtime.py: the tiny-model run completes, writes every figure, and
both baselines reproduce the executor's state bit for bit (no speed is asserted: timings are reported)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.rayless]  # no Ray: may run beside the Ray tests


def test_small_run_writes_all_figures(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    proc = subprocess.run([sys.executable, "benchmarks/transition_runtime.py", "--small", "--repeats", "1",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "summary:" in proc.stdout
    data = json.loads(out.read_text())
    assert data["links"]["p2p_bytes_per_s"] > 0 and data["links"]["memcpy_bytes_per_s"] > 0
    assert len(data["transitions"]) == 5
    for row in data["transitions"]:
        assert row["dcp_equal"] and row["gs_equal"], row["label"]
        for key in ("exec_s", "dcp_s", "gs_s", "predicted_s", "bandwidth_bound_s", "graph_bandwidth_bound_s"):
            assert row[key] > 0, (row["label"], key)
        assert set(row["exec_phases_s"]) >= {"prepare", "copy", "move", "data_vote", "install", "commit_vote"}
        assert row["shared_link_bound_s"] > 0
    assert not list((ROOT / ".tmp").glob("transition_runtime_*/t*")), "DCP files were left behind"
