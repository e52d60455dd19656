"""The MoE all-to-all (``cost.moe.all_to_all_time``) against DeepEP's published decode latencies
(``nereus/cost/moe_all_to_all_published.csv``, sources in ``moe_all_to_all_published.md``): nothing fitted;
the model prices Megatron-style per-(token, expert) sends, so it must not be faster than DeepEP and stays
within 3.5x."""

from __future__ import annotations

import csv
from importlib import resources

from nereus.cost.hardware import Hardware
from nereus.cost.moe import all_to_all_time
from nereus.spec.cluster import ClusterSpec, gpu_presets


def _rows() -> list[dict]:
    text = resources.files("nereus.cost").joinpath("moe_all_to_all_published.csv").read_text()
    return list(csv.DictReader(line for line in text.splitlines() if not line.startswith("#")))


def test_all_to_all_within_the_stated_bound_of_deepep() -> None:
    ratios = []
    for row in _rows():
        ep = int(row["ep"])
        hw = Hardware(ClusterSpec(gpu_presets()["H800"], ep, 8))
        nbytes = int(row["tokens"]) * int(row["top_k"]) * int(row["hidden"]) * int(row["elem_bytes"])
        predicted_us = all_to_all_time(hw, nbytes, ep, stride=8) * 1e6  # pure RDMA: every peer off the node
        ratios.append(predicted_us / float(row["published_us"]))
    assert len(ratios) == 12
    mean_abs_pct = 100 * sum(abs(r - 1) for r in ratios) / len(ratios)
    print(f"DeepEP low-latency rows: mean {mean_abs_pct:.0f}% (ratios {min(ratios):.2f}-{max(ratios):.2f})")
    assert all(1.0 <= r <= 3.5 for r in ratios)
    assert mean_abs_pct < 100
