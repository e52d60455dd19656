"""benchmarks/chaos.py's bookkeeping, without processes: each in-process kind arms a fault point the runtime
has, a sample lost is a training prompt the uninterrupted run trained on and the recovered one did not, and
"equal weights" means every tensor within the tolerances, with the largest difference reported. The recoveries
it drives are tested where they happen: tests/runtime/recovery/test_failover.py (mid-backward, weight sync,
mid-decode, mid-transition), tests/control/test_loop.py (a loss in a transition keeps the finished step),
tests/run/test_vllm_job.py (a vLLM engine mid-generation), tests/runtime/cluster/test_multinode.py (a lost
node). The benchmark itself starts 9 jobs (minutes): its figures are in docs/reliability.md."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from nereus.runtime.comm.faults import POINTS

ROOT = Path(__file__).resolve().parents[2]


def load_chaos():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # chaos.py imports its neighbour recovery.py
    try:
        spec = importlib.util.spec_from_file_location("chaos_bench", ROOT / "benchmarks" / "chaos.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_each_kind_arms_a_point_the_runtime_has():
    chaos = load_chaos()
    assert set(chaos.POINTS.values()) <= set(POINTS)
    assert chaos.KINDS == ("generation_mid_decode", "trainer_mid_backward", "weight_sync", "live_transition", "node")


def test_samples_lost_counts_prompts_never_trained_on():
    chaos = load_chaos()
    want = {0: [3, 5], 1: [7, 7], 2: [1, 2]}
    assert chaos.samples_lost(want, want, 4) == 0
    assert chaos.samples_lost({0: [3, 5], 1: [7], 2: [2, 1]}, want, 4) == 4  # one of step 1's two rows 7
    assert chaos.samples_lost({0: [3, 5]}, want, 2) == 8  # steps 1 and 2 never trained


def test_weights_equal_within_tolerance_and_the_worst_difference_is_reported():
    chaos = load_chaos()
    want = {"actor": {"w": torch.zeros(3)}, "critic": {"v": torch.ones(2)}}
    near = {"actor": {"w": torch.tensor([0.0, 1e-7, 0.0])}, "critic": {"v": torch.ones(2)}}
    far = {"actor": {"w": torch.tensor([0.0, 0.0, 1e-3])}, "critic": {"v": torch.ones(2)}}
    assert chaos.compare(near, want, 1e-4, 1e-5) == (True, torch.tensor(1e-7).item())
    equal, worst = chaos.compare(far, want, 1e-4, 1e-5)
    assert not equal and abs(worst - 1e-3) < 1e-9
