"""The cluster's link model for transitions: achieved rates and per-message latencies per link kind,
from the cost model's hardware priors (shared by the source assignment, the scheduler, the verifier, the
bounds and the baselines)."""

from __future__ import annotations

from dataclasses import dataclass

from nereus.cost.hardware import Hardware, pcie_bytes_per_s


@dataclass(frozen=True)
class Links:
    """Achieved rates (bytes/s, one direction) and per-message latencies, from the cost model's priors."""

    nvlink: float
    ib: float
    pcie: float
    hbm: float
    intra_latency_s: float
    inter_latency_s: float

    @staticmethod
    def of(hw: Hardware) -> Links:
        gpu, p = hw.cluster.gpu, hw.priors
        # Host↔device copies reach ~80% of PCIe (as NCCL reaches ~80% of NVLink/IB: one efficiency prior);
        # the link's rate by PCIe generation is the cost model's (``cost.hardware.pcie_bytes_per_s``).
        return Links(gpu.intra_node_bytes_per_s * p.intra_link_efficiency,
                     gpu.inter_node_bytes_per_s * p.inter_link_efficiency,
                     pcie_bytes_per_s(hw) * p.intra_link_efficiency, gpu.hbm_bytes_per_s * p.hbm_efficiency,
                     p.intra_latency_s, p.inter_latency_s)
