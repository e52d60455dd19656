"""Cluster description: GPU figures (presets from datasheets, or custom) and node shape."""

from __future__ import annotations

import csv
from dataclasses import dataclass, replace
from functools import lru_cache
from importlib import resources

from nereus.spec.errors import SpecError
from nereus.spec.fields import Fields

GB = 1e9


@dataclass(frozen=True)
class GpuSpec:
    """Datasheet figures of one device; bandwidths in bytes/s, one direction per device."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes_per_s: float
    memory_bytes: float
    intra_node_bytes_per_s: float  # NVLink, per device, one direction (half the bidirectional total)
    inter_node_bytes_per_s: float  # one NIC per device, one direction


@lru_cache(maxsize=1)
def gpu_presets() -> dict[str, GpuSpec]:
    """Presets from ``hardware.csv`` (a copy of ``shared/data/hardware.csv``; it cites the datasheets)."""
    text = resources.files("nereus.spec").joinpath("hardware.csv").read_text()
    rows = csv.DictReader(line for line in text.splitlines() if not line.startswith("#"))
    presets = {}
    for row in rows:
        gpu = GpuSpec(
            name=row["gpu"],
            peak_flops=float(row["bf16_dense_tflops"]) * 1e12,
            hbm_bytes_per_s=float(row["hbm_tb_per_s"]) * 1e12,
            memory_bytes=float(row["hbm_gb"]) * GB,
            intra_node_bytes_per_s=float(row["nvlink_gb_per_s_bidir"]) * GB / 2,
            inter_node_bytes_per_s=float(row["ib_gbit_per_s_per_gpu"]) * GB / 8,
        )
        presets[gpu.name] = gpu
        family = gpu.name.split("-")[0]  # "A100", "H100", "H200"
        presets[family] = gpu
        presets[f"{family}-{row['hbm_gb']}GB"] = gpu
    return presets


@dataclass(frozen=True)
class ClusterSpec:
    gpu: GpuSpec
    nodes: int
    gpus_per_node: int

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def with_gpus(self, total: int) -> ClusterSpec:
        """The same hardware with ``total`` GPUs (whole nodes, or part of one node when fewer)."""
        if total < 1:
            raise SpecError("--gpus", f"must be >= 1, got {total}")
        if total <= self.gpus_per_node:
            return replace(self, nodes=1, gpus_per_node=total)
        if total % self.gpus_per_node:
            raise SpecError("--gpus", f"{total} is not a multiple of gpus_per_node ({self.gpus_per_node})")
        return replace(self, nodes=total // self.gpus_per_node)

    def node_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_node

    def to_dict(self) -> dict:
        g = self.gpu
        return {
            "gpu": {"name": g.name, "peak_tflops": g.peak_flops / 1e12, "hbm_tb_per_s": g.hbm_bytes_per_s / 1e12,
                    "memory_gb": g.memory_bytes / GB, "intra_node_gb_per_s": g.intra_node_bytes_per_s / GB,
                    "inter_node_gb_per_s": g.inter_node_bytes_per_s / GB},
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
        }


def read_cluster(f: Fields) -> ClusterSpec:
    """``gpu: NAME`` (a preset) or ``gpu: {name, peak_tflops, ...}``; overrides per figure are allowed."""
    presets = gpu_presets()
    if isinstance(f.data.get("gpu"), dict):
        g = f.sub("gpu")
        gpu = GpuSpec(
            name=g.get("name", str, "custom"),
            peak_flops=g.get("peak_tflops", float, minimum=1e-6) * 1e12,
            hbm_bytes_per_s=g.get("hbm_tb_per_s", float, minimum=1e-6) * 1e12,
            memory_bytes=g.get("memory_gb", float, minimum=1e-6) * GB,
            intra_node_bytes_per_s=g.get("intra_node_gb_per_s", float, minimum=1e-6) * GB,
            inter_node_bytes_per_s=g.get("inter_node_gb_per_s", float, minimum=1e-6) * GB,
        )
        g.finish()
    else:
        gpu = presets[f.get("gpu", str, choices=sorted(presets))]
    overrides = {
        "memory_gb": ("memory_bytes", GB),
        "intra_node_gb_per_s": ("intra_node_bytes_per_s", GB),
        "inter_node_gb_per_s": ("inter_node_bytes_per_s", GB),
    }
    for key, (attr, scale) in overrides.items():
        value = f.get(key, float, None, minimum=1e-6)
        if value is not None:
            gpu = replace(gpu, **{attr: value * scale})
    cluster = ClusterSpec(
        gpu=gpu,
        nodes=f.get("nodes", int, 1, minimum=1),
        gpus_per_node=f.get("gpus_per_node", int, 8, minimum=1),
    )
    f.finish()
    return cluster
