"""`nereus profile`: measure this machine's ``cpu-local`` hardware profile for the cost model.

N local worker processes (``launch.run_world``: forked ranks, gloo, one thread each, as the runtime runs
them) measure together, so every figure is what one worker achieves while all of them are busy:

- matmul FLOP/s per worker: the fp32 GEMMs of one transformer layer (QKV, attention output, SwiGLU gate/up,
  down projection) over ``tokens`` rows;
- memory bandwidth per worker: a streaming add ``c = a + b`` over arrays far larger than the caches
  (bytes = read a + read b + write c, as STREAM counts them); a copy is reported alongside;
- gloo all-reduce of a small message (latency) and a large one (bus bandwidth), and a point-to-point ring
  exchange (every worker sends to the next and receives from the previous at once).

Each measurement runs ``repeats`` times after one warm-up; the figure is the median, and a repeat's time is
the slowest worker's. The result maps onto the cost model as a cluster section (``gpu:`` figures, measured
achieved rates, with ``priors:`` efficiencies 1.0 and the alpha-beta latency per ring step), written as
YAML that a job spec includes with ``cluster: {profile: FILE}`` or pastes under ``cluster:``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from nereus.runtime.cluster.launch import run_world

MIB = 2**20


@dataclass(frozen=True)
class ProfileSizes:
    """Problem sizes; the defaults take about ten seconds with 4 workers on 2 cores, tests use tiny ones."""

    tokens: int = 512  # rows of every GEMM (micro-batch x sequence)
    hidden: int = 512  # hidden size; FFN width 8/3 x hidden (rounded to 64), MHA QKV 3 x hidden
    matmul_layers: int = 2  # layers of GEMMs per repeat
    stream_mib: float = 64  # size of each of the three streaming arrays
    stream_iters: int = 3
    small_bytes: int = 256  # all-reduce latency message
    small_iters: int = 20
    large_mib: float = 16  # all-reduce and point-to-point bandwidth message
    large_iters: int = 3
    repeats: int = 5

    @property
    def ffn(self) -> int:
        return max(64, round(8 * self.hidden / 3 / 64) * 64)

    def gemms(self) -> list[tuple[int, int, int]]:
        """(m, k, n) of one layer's GEMMs."""
        h, f, m = self.hidden, self.ffn, self.tokens
        return [(m, h, 3 * h), (m, h, h), (m, h, 2 * f), (m, f, h)]

    def matmul_flops(self) -> float:
        return self.matmul_layers * sum(2.0 * m * k * n for m, k, n in self.gemms())


DEFAULT_SIZES = ProfileSizes()


@dataclass(frozen=True)
class Profile:
    """Measured figures of one machine; rates per worker, times of one operation (medians, SI units)."""

    workers: int
    memory_gb: float  # configured budget per worker, not measured
    matmul_flops_per_s: float
    stream_bytes_per_s: float  # streaming add
    copy_bytes_per_s: float
    all_reduce_small_s: float  # one all-reduce of ``small_bytes``
    all_reduce_large_s: float  # one all-reduce of ``large_mib``
    p2p_s: float  # one ring exchange of ``large_mib``
    sizes: ProfileSizes
    spread: dict[str, tuple[float, float]]  # measurement -> (min, max) over the repeats, same unit as above
    host: str = ""
    load_average: float = 0.0  # 1-minute load average just before measuring (other processes lower every figure)

    @property
    def ring_steps(self) -> int:
        """Latency steps of a ring all-reduce in the cost model (``Hardware.all_reduce_time``): 2(n−1)."""
        return 2 * (self.workers - 1)

    @property
    def latency_per_step_s(self) -> float:
        """Alpha of the cost model: a small all-reduce is 2(n−1) latency steps (its bytes are negligible)."""
        return self.all_reduce_small_s / self.ring_steps

    @property
    def all_reduce_bus_bytes_per_s(self) -> float:
        """Bus bandwidth: 2(n−1)/n · bytes over the large all-reduce's time less its latency steps (never
        less than half its time, so a noisy latency cannot inflate it)."""
        n, nbytes = self.workers, self.sizes.large_mib * MIB
        t = max(self.all_reduce_large_s - self.ring_steps * self.latency_per_step_s, 0.5 * self.all_reduce_large_s)
        return 2 * (n - 1) / n * nbytes / t

    @property
    def p2p_bytes_per_s(self) -> float:
        """Per worker, one direction, all workers sending at once (less one latency step, as ``p2p_time``)."""
        t = max(self.p2p_s - self.latency_per_step_s, 0.5 * self.p2p_s)
        return self.sizes.large_mib * MIB / t

    def cluster_section(self) -> dict:
        """The cluster section of a job spec (``nereus.spec.cluster.read_cluster``). Link rates are the
        all-reduce bus bandwidth: the model's collectives divide by it, and one host has no network, so the
        inter-node figure repeats the intra-node one."""
        link = _round(self.all_reduce_bus_bytes_per_s / 1e9)
        latency = _round(self.latency_per_step_s)
        return {
            "gpu": {"name": "cpu-local", "peak_tflops": _round(self.matmul_flops_per_s / 1e12),
                    "hbm_tb_per_s": _round(self.stream_bytes_per_s / 1e12), "memory_gb": float(self.memory_gb),
                    "intra_node_gb_per_s": link, "inter_node_gb_per_s": link},
            "priors": {"gemm_efficiency": 1.0, "hbm_efficiency": 1.0, "intra_link_efficiency": 1.0,
                       "inter_link_efficiency": 1.0, "intra_latency_s": latency, "inter_latency_s": latency},
            "nodes": 1,
            "gpus_per_node": self.workers,
        }

    def to_yaml(self) -> str:
        """The cluster section as YAML, headed by comments that record what was measured and how."""
        s, n = self.sizes, self.workers

        def rng(key: str, scale: float, fmt: str) -> str:
            lo, hi = self.spread[key]
            return f"[{format(lo * scale, fmt)}..{format(hi * scale, fmt)}]"

        flops = s.matmul_flops()
        stream_b, copy_b = (k * s.stream_mib * MIB * s.stream_iters for k in (3, 2))
        lines = [
            f"# cpu-local hardware profile measured by `nereus profile` on {self.host}",
            f"# load average before measuring: {self.load_average:.2f} (other busy processes lower every figure)",
            f"# {n} worker processes (1 thread each, gloo), all busy at once; median of {s.repeats} repeats "
            "[range over the repeats]:",
            f"#   matmul fp32, {s.tokens} tokens x hidden {s.hidden} (QKV, out, gate/up, down; ffn {s.ffn}): "
            f"{self.matmul_flops_per_s / 1e9:.3g} GFLOP/s per worker "
            f"{_rate_range(self.spread['matmul'], flops / 1e9, '.3g')}",
            f"#   streaming add, 3 x {s.stream_mib:g} MiB fp32: {self.stream_bytes_per_s / 1e9:.3g} GB/s per worker "
            f"{_rate_range(self.spread['stream'], stream_b / 1e9, '.3g')}; copy "
            f"{self.copy_bytes_per_s / 1e9:.3g} GB/s {_rate_range(self.spread['copy'], copy_b / 1e9, '.3g')}",
            f"#   all-reduce {s.small_bytes} B: {self.all_reduce_small_s * 1e3:.3g} ms {rng('small', 1e3, '.3g')}"
            f" = {self.ring_steps} ring steps of {_duration(self.latency_per_step_s)} (priors.*_latency_s)",
            f"#   all-reduce {s.large_mib:g} MiB: {self.all_reduce_large_s * 1e3:.3g} ms {rng('large', 1e3, '.3g')}"
            f" -> bus bandwidth {self.all_reduce_bus_bytes_per_s / 1e9:.3g} GB/s (gpu.*_node_gb_per_s)",
            f"#   point-to-point ring exchange {s.large_mib:g} MiB: {self.p2p_s * 1e3:.3g} ms "
            f"{rng('p2p', 1e3, '.3g')} -> {self.p2p_bytes_per_s / 1e9:.3g} GB/s per worker, one direction",
            "# Figures are achieved rates, so every efficiency prior is 1.0. memory_gb is the configured budget",
            "# per worker (--memory-gb), not measured. Use: `cluster: {profile: THIS_FILE}` in a job spec (keys",
            "# given there override this file's), or paste the keys below under `cluster:`.",
        ]
        return "\n".join(lines) + "\n" + yaml.safe_dump(self.cluster_section(), sort_keys=False)


def _round(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def _duration(seconds: float) -> str:
    return f"{seconds * 1e6:.3g} us" if seconds < 1e-3 else f"{seconds * 1e3:.3g} ms"


def _rate_range(times: tuple[float, float], work: float, fmt: str) -> str:
    """The rates of the slowest and the fastest repeat."""
    lo, hi = times
    return f"[{format(work / hi, fmt)}..{format(work / lo, fmt)}]"


def _timed(fn: Callable[[], None], repeats: int, barrier_after: bool = True) -> list[float]:
    """Times of ``repeats`` runs of ``fn`` after one warm-up, each from a common start to the slowest
    worker's end (a trailing barrier; collectives synchronise by themselves)."""
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        if barrier_after:
            dist.barrier()
        if i:
            times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def _measure(rank: int, world: int, sizes: ProfileSizes, out_path: str) -> None:
    g = torch.Generator().manual_seed(rank)
    # Matmul: one transformer layer's GEMMs, outputs preallocated so only the GEMMs are timed.
    ops = []
    for m, k, n in sizes.gemms():
        ops.append((torch.randn(m, k, generator=g), torch.randn(k, n, generator=g), torch.empty(m, n)))

    def matmul() -> None:
        for _ in range(sizes.matmul_layers):
            for a, b, c in ops:
                torch.mm(a, b, out=c)

    numel = int(sizes.stream_mib * MIB) // 4
    a, b, c = torch.rand(numel, generator=g), torch.rand(numel, generator=g), torch.empty(numel)

    def stream_add() -> None:
        for _ in range(sizes.stream_iters):
            torch.add(a, b, out=c)

    def stream_copy() -> None:
        for _ in range(sizes.stream_iters):
            c.copy_(a)

    small = torch.ones(max(1, sizes.small_bytes // 4))
    large = torch.ones(int(sizes.large_mib * MIB) // 4)
    recv = torch.empty_like(large)

    def all_reduce_small() -> None:
        for _ in range(sizes.small_iters):
            dist.all_reduce(small)

    def all_reduce_large() -> None:
        for _ in range(sizes.large_iters):
            dist.all_reduce(large)

    def ring_exchange() -> None:
        for _ in range(sizes.large_iters):
            reqs = [dist.isend(large, (rank + 1) % world), dist.irecv(recv, (rank - 1) % world)]
            for r in reqs:
                r.wait()

    results = {
        "matmul": _timed(matmul, sizes.repeats),
        "stream": _timed(stream_add, sizes.repeats),
        "copy": _timed(stream_copy, sizes.repeats),
        "small": [t / sizes.small_iters for t in _timed(all_reduce_small, sizes.repeats, barrier_after=False)],
        "large": [t / sizes.large_iters for t in _timed(all_reduce_large, sizes.repeats, barrier_after=False)],
        "p2p": [t / sizes.large_iters for t in _timed(ring_exchange, sizes.repeats)],
    }
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))


def _host() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"{platform.node()} ({cpu}, {os.cpu_count()} logical CPUs), torch {torch.__version__}, {when}"


def load_average() -> float:
    """The 1-minute load average (0 where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def measure(workers: int = 4, memory_gb: float = 4.0, sizes: ProfileSizes | None = None,
            timeout_s: float = 300.0) -> Profile:
    """Run the measurements on ``workers`` local processes (gloo, one thread each) and return the medians."""
    if workers < 2:
        raise ValueError(f"workers must be >= 2 (collectives need two), got {workers}")
    if memory_gb <= 0:
        raise ValueError(f"memory_gb must be > 0, got {memory_gb}")
    sizes = sizes or DEFAULT_SIZES
    load = load_average()
    with tempfile.TemporaryDirectory(prefix="nereus-profile-") as tmp:
        out = Path(tmp) / "times.json"
        run_world(_measure, workers, sizes, str(out), timeout_s=timeout_s, backend="gloo")
        times: dict[str, list[float]] = json.loads(out.read_text())
    med = {k: statistics.median(v) for k, v in times.items()}
    array = sizes.stream_mib * MIB * sizes.stream_iters
    return Profile(
        workers=workers, memory_gb=memory_gb,
        matmul_flops_per_s=sizes.matmul_flops() / med["matmul"],
        stream_bytes_per_s=3 * array / med["stream"],
        copy_bytes_per_s=2 * array / med["copy"],
        all_reduce_small_s=med["small"], all_reduce_large_s=med["large"], p2p_s=med["p2p"],
        sizes=sizes, spread={k: (min(v), max(v)) for k, v in times.items()}, host=_host(), load_average=load,
    )
