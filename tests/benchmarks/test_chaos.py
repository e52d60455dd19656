"""Smoke test of benchmarks/chaos.py on the kind whose job-level path only it drives: a worker killed in the
transfers of a live transition. The job records the finished step, recovers on the survivors from the snapshot
taken before the move, loses no step and no sample, and ends on the weights of an uninterrupted run. The other
kinds' recoveries are tested where they happen: tests/runtime/recovery/test_failover.py (mid-backward, weight
sync, mid-decode, mid-transition), tests/run/test_vllm_job.py (a vLLM engine mid-generation) and
tests/runtime/cluster/test_multinode.py (a lost node)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# its own Ray instance in the benchmark's process, none of the session's: it may run beside the Ray group
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.beside_ray]


def test_chaos_recovers_a_worker_lost_in_a_live_transition() -> None:
    cmd = [sys.executable, "benchmarks/chaos.py", "--kinds", "live_transition", "--steps", "2", "--json"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])["kinds"]["live_transition"]
    assert result["recovered"] and result["lost_workers"] == [1]
    assert result["steps_lost"] == 0 and result["samples_lost"] == 0  # the move was lost, not the step
    assert result["weights_equal"], result["max_abs_weight_diff"]
    assert result["recover_s"] > 0
