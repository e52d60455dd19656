"""The cluster's link model for transitions: achieved rates and per-message latencies per link kind,
from the cost model's hardware priors (shared by the source assignment, the scheduler, the verifier, the
bounds and the baselines)."""

from __future__ import annotations

from dataclasses import dataclass

from nereus.cost.hardware import Hardware

# PCIe x16 per direction: 4.0 = 16 GT/s/lane, 5.0 = 32 GT/s/lane, 128b/130b encoding (PCI-SIG base specs):
# 31.5 and 63 GB/s. A100 SXM hosts attach over PCIe 4.0, H100/H200 SXM over PCIe 5.0 (NVIDIA datasheets).
PCIE_BYTES_PER_S = {"A100": 31.5e9, "H100": 63e9, "H200": 63e9}
PCIE_DEFAULT = 31.5e9


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
        pcie = PCIE_BYTES_PER_S.get(gpu.name.split("-")[0], PCIE_DEFAULT)
        # Host↔device copies reach ~80% of PCIe (as NCCL reaches ~80% of NVLink/IB: one efficiency prior).
        return Links(gpu.intra_node_bytes_per_s * p.intra_link_efficiency,
                     gpu.inter_node_bytes_per_s * p.inter_link_efficiency,
                     pcie * p.intra_link_efficiency, gpu.hbm_bytes_per_s * p.hbm_efficiency,
                     p.intra_latency_s, p.inter_latency_s)
