"""Smoke test of benchmarks/gpu_check.py on CPU (``--smoke``: the tiny shape, fewest calls): every figure is
measured and priced, the static-buffer decode's (eager: no CUDA graph on CPU) and the packed-vs-padded
training pass's (the vLLM part, which the lent GPU machines cannot run, is left out to keep the suite
short; ``--device cpu --small`` runs it where vLLM is installed); the JSON is in the file and on the last line (no speed
is asserted: a decode figure per token is the difference of two medians, which on a busy machine with
this tiny shape can come out negative)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.rayless]  # no Ray: may run beside the Ray tests


def test_gpu_check_small_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--smoke", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    [result] = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [result]
    names = {r["name"] for r in result["rows"]}
    assert any(n.startswith("training step") for n in names)
    assert {f"native decode per token, batch {b}" for b in (1, 3)} <= names
    assert {f"native static {k}, batch {b}" for b in (1, 3) for k in ("decode per token", "eager step")} <= names
    for figures in result["decode"].values():
        assert figures["graphed_step_ms"] is None and figures["eager_step_ms"] > 0  # no graph without CUDA
        assert figures["predicted_ms_per_token"] > 0 and math.isfinite(figures["loop_over_predicted"])
    packing = result["packing"]
    assert 0 < packing["padding_fraction"] < 1 and packing["real_tokens"] > 0
    assert packing["packed"]["tokens_per_s"] > 0 and packing["padded"]["tokens_per_s"] > 0
    assert not any(n.startswith("vllm") for n in names)
    for r in result["rows"]:
        assert math.isfinite(r["measured_s"]) and r["predicted_s"] > 0, r
        assert r["measured_s"] > 0 or "per token" in r["name"], r  # a timed call itself always takes time
