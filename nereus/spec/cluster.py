"""Cluster description: GPU figures (presets from datasheets, a custom mapping, or a measured profile
file), optional overrides of the cost model's hardware priors, and node shape."""

from __future__ import annotations

import csv
from dataclasses import dataclass, field, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path

from nereus.spec.errors import SpecError
from nereus.spec.fields import MAX_GPUS, Fields
from nereus.spec.files import read_yaml_file

GB = 1e9
GIB = 1024**3

# ``priors:`` keys of a cluster section: spec key -> (field of ``nereus.cost.hardware.Priors``, unit scale,
# minimum, maximum). Efficiencies are fractions of the figures under ``gpu:`` (1.0 when those figures are
# measured achieved rates, as ``nereus profile`` writes them).
PRIOR_KEYS: dict[str, tuple[str, float, float, float | None]] = {
    "gemm_efficiency": ("gemm_efficiency", 1.0, 1e-6, 1.0),
    "hbm_efficiency": ("hbm_efficiency", 1.0, 1e-6, 1.0),
    "intra_link_efficiency": ("intra_link_efficiency", 1.0, 1e-6, 1.0),
    "inter_link_efficiency": ("inter_link_efficiency", 1.0, 1e-6, 1.0),
    "intra_latency_s": ("intra_latency_s", 1.0, 0.0, None),
    "inter_latency_s": ("inter_latency_s", 1.0, 0.0, None),
    "decode_step_overhead_s": ("decode_step_overhead_s", 1.0, 0.0, None),
    "micro_batch_overhead_s": ("micro_batch_overhead_s", 1.0, 0.0, None),
    "transition_fixed_s": ("transition_fixed_s", 1.0, 0.0, None),
    "transition_per_stage_s": ("transition_per_stage_s", 1.0, 0.0, None),
    "engine_start_s": ("engine_start_s", 1.0, 0.0, None),
    "host_cores": ("host_cores", 1.0, 0.0, None),
    "reserved_gib": ("reserved_bytes", GIB, 0.0, None),
    "kv_memory_fraction": ("kv_memory_fraction", 1.0, 1e-6, 1.0),
}


# A device figure (TFLOP/s, TB/s, GB, GB/s) above 10^6 is a typo (an H100 has 989 TFLOP/s, 80 GB); the
# bound keeps the cost model's products finite. A node holds at most 1,024 devices (NVL72 racks: 72).
MAX_FIGURE = 1e6
MAX_GPUS_PER_NODE = 1024

@dataclass(frozen=True)
class GpuSpec:
    """Datasheet figures of one device; bandwidths in bytes/s, one direction per device."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes_per_s: float
    memory_bytes: float
    intra_node_bytes_per_s: float  # NVLink, per device, one direction (half the bidirectional total)
    inter_node_bytes_per_s: float  # one NIC per device, one direction
    nvlink_domain: int = 8  # GPUs one NVLink switch fabric joins (an HGX board 8, a GB200 NVL72 rack 72)


@lru_cache(maxsize=1)
def gpu_presets() -> dict[str, GpuSpec]:
    """Presets from ``hardware.csv`` (package data; its header cites the datasheets)."""
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
            nvlink_domain=int(row["nvlink_domain_gpus"]),
        )
        presets[gpu.name] = gpu
        family = gpu.name.split("-")[0]  # "A100", "H100", "H200"
        presets[family] = gpu
        presets[f"{family}-{row['hbm_gb']}GB"] = gpu
    return presets


def nvlink_node(domain: int, total: int, per_node: int) -> int:
    """The GPUs of a node as the cost model takes it, the NVLink domain its collectives stay within, for
    ``total`` GPUs on hosts of ``per_node``: a GB200 NVL72 tray holds 4, but NVLink joins the rack's 72
    (``GpuSpec.nvlink_domain``; NeMo RL's and Megatron-Bridge's GB200 runs are written as 4-GPU nodes). The
    largest multiple of the host's GPUs that divides the run's GPUs and fits in one domain (a 128-GPU run:
    two domains of 64, where the racks hold 72 and 56)."""
    if domain <= per_node:
        return per_node
    return max(k * per_node for k in range(1, domain // per_node + 1) if total % (k * per_node) == 0)


@dataclass(frozen=True)
class ClusterSpec:
    gpu: GpuSpec
    nodes: int
    gpus_per_node: int
    # Overrides of the cost model's priors as (Priors field, value in SI units); empty: the defaults.
    priors: tuple[tuple[str, float], ...] = field(default=())

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def with_gpus(self, total: int) -> ClusterSpec:
        """The same hardware with ``total`` GPUs (whole nodes, or part of one node when fewer)."""
        if total < 1:
            raise SpecError("--gpus", f"must be >= 1, got {total}")
        if total > MAX_GPUS:
            raise SpecError("--gpus", f"{total} is more GPUs than nereus plans for (at most {MAX_GPUS:,}, about "
                                      "the largest single-job clusters); give a smaller count")
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
            **({"priors": _priors_to_spec(self.priors)} if self.priors else {}),
        }


def _priors_to_spec(priors: tuple[tuple[str, float], ...]) -> dict[str, float]:
    by_field = {attr: (key, scale) for key, (attr, scale, _, _) in PRIOR_KEYS.items()}
    return {by_field[attr][0]: value / by_field[attr][1] for attr, value in priors}


def _read_priors(f: Fields) -> dict[str, float]:
    """``priors: {gemm_efficiency: .., intra_latency_s: .., ...}`` -> {Priors field: value in SI units}."""
    out = {}
    for key, (attr, scale, low, high) in PRIOR_KEYS.items():
        value = f.get(key, float, None, minimum=low, maximum=MAX_FIGURE if high is None else high)
        if value is not None:
            out[attr] = value * scale
    f.finish()
    return out


def read_profile(path: Path, where: str = "profile") -> ClusterSpec:
    """A cluster section kept in its own YAML file (``nereus profile --out`` writes one); errors name
    ``where``, the file and the key inside it."""
    if not path.exists():
        raise SpecError(where, f"profile file not found: {path}")
    try:
        data = read_yaml_file(path, "profile")
    except SpecError as err:
        raise SpecError(where, f"profile {err}") from None
    if isinstance(data, dict) and "profile" in data:
        raise SpecError(f"{where} ({path}) profile", "a profile file cannot name another profile")
    try:
        return read_cluster(Fields(data, ""))
    except SpecError as err:
        raise SpecError(f"{where} ({path}) {err.path}".rstrip(), err.message) from None


def read_cluster(f: Fields, base_dir: Path | None = None) -> ClusterSpec:
    """``gpu: NAME`` (a preset) or ``gpu: {name, peak_tflops, ...}``; overrides per figure are allowed.

    ``profile: FILE`` (relative to ``base_dir``, the job file's folder) reads a cluster section from a file
    such as ``nereus profile`` writes; keys given here override the file's (``priors`` key by key).
    """
    presets = gpu_presets()
    base = None
    profile = f.get("profile", str, None)
    if profile is not None:
        base = read_profile((base_dir or Path(".")) / profile, f.key_path("profile"))
    if base is not None and f.data.get("gpu") is None:
        f.get("gpu", (str, dict), None)
        gpu = base.gpu
    elif isinstance(f.data.get("gpu"), dict):
        g = f.sub("gpu")
        gpu = GpuSpec(
            name=g.get("name", str, "custom"),
            peak_flops=g.get("peak_tflops", float, minimum=1e-6, maximum=MAX_FIGURE) * 1e12,
            hbm_bytes_per_s=g.get("hbm_tb_per_s", float, minimum=1e-6, maximum=MAX_FIGURE) * 1e12,
            memory_bytes=g.get("memory_gb", float, minimum=1e-6, maximum=MAX_FIGURE) * GB,
            intra_node_bytes_per_s=g.get("intra_node_gb_per_s", float, minimum=1e-6, maximum=MAX_FIGURE) * GB,
            inter_node_bytes_per_s=g.get("inter_node_gb_per_s", float, minimum=1e-6, maximum=MAX_FIGURE) * GB,
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
        value = f.get(key, float, None, minimum=1e-6, maximum=MAX_FIGURE)
        if value is not None:
            gpu = replace(gpu, **{attr: value * scale})
    priors = dict(base.priors) if base is not None else {}
    priors.update(_read_priors(f.sub("priors")))
    cluster = ClusterSpec(
        gpu=gpu,
        nodes=f.get("nodes", int, base.nodes if base is not None else 1, minimum=1, maximum=MAX_GPUS),
        gpus_per_node=f.get("gpus_per_node", int, base.gpus_per_node if base is not None else 8, minimum=1,
                            maximum=MAX_GPUS_PER_NODE),
        priors=tuple(sorted(priors.items())),
    )
    f.finish()
    if cluster.num_gpus > MAX_GPUS:
        raise SpecError(f.key_path("nodes"), f"{cluster.nodes} nodes x {cluster.gpus_per_node} GPUs is more than "
                                             f"nereus plans for (at most {MAX_GPUS:,} GPUs, about the largest "
                                             "single-job clusters); give fewer nodes")
    return cluster
