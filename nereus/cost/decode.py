"""Decode (generation) time of one inference-engine replica: per-step roofline and continuous batching.

Validated against published TensorRT-LLM and vLLM figures (``decode_published.csv``, package data;
``tests/test_decode_published.py``) and not yet used by the planner (``nereus.cost.stages`` keeps its own
generation model until the planner is moved over deliberately).

One decode step of a tensor-parallel replica (Pope et al. 2022, "Efficiently Scaling Transformer
Inference", Sec. 2–3) costs, per layer, each GEMM's max(weight shard read, FLOPs at an efficiency set by
tile and wave quantization of the shard), the KV-cache read of every active sequence at its current
context, two all-reduces of b·h activations (Shoeybi et al. 2019), plus the engine's fixed cost per step
and its cost per active sequence. A generation runs a bulk phase at the engine's batch, slots refilling as
sequences end (Yu et al. 2022, "Orca", iteration-level scheduling), then a tail as the batch drains.
"""

from __future__ import annotations

import csv
import heapq
import math
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources

from nereus.cost.hardware import Hardware
from nereus.spec.model import ModelArch


@lru_cache(maxsize=1)
def _gpu_extras() -> dict[str, tuple[float, int]]:
    """FP8 dense peak (FLOP/s, 0 where none) and SM count per GPU preset, from ``hardware.csv``."""
    text = resources.files("nereus.spec").joinpath("hardware.csv").read_text()
    rows = csv.DictReader(line for line in text.splitlines() if not line.startswith("#"))
    extras = {}
    for row in rows:
        value = (float(row["fp8_dense_tflops"]) * 1e12, int(row["sms"]))
        extras[row["gpu"]] = value
        extras[row["gpu"].split("-")[0]] = value
    return extras


@dataclass(frozen=True)
class EngineCosts:
    """Host-side costs of an inference engine that no GPU roofline sees."""

    # Fixed cost of one decode iteration: scheduling, sampling, launch of the step's CUDA graph.
    step_s: float
    # Cost per active sequence per iteration: batch bookkeeping, input preparation, detokenisation.
    sequence_s: float


# vLLM's Python scheduler and input preparation dominated Llama-3-8B decode on one H100 before v0.6.0
# ("vLLM v0.6.0: 2.7x Throughput Improvement and 5x Latency Reduction", vLLM blog, 2024-09-05: HTTP
# server 33%, scheduling 29% of execution time); after it, a millisecond-scale fixed cost per step
# remains (the same blog's TPOT figures), with per-sequence work on the order of tens of µs. TensorRT-LLM
# schedules in C++ (in-flight batching in its batch manager) and replays CUDA graphs, so both costs are
# several times smaller. Orders of magnitude from those sources, not fitted to the validation rows.
ENGINES: dict[str, EngineCosts] = {
    "vllm": EngineCosts(step_s=1.0e-3, sequence_s=20e-6),
    "trtllm": EngineCosts(step_s=0.3e-3, sequence_s=5e-6),
}


@dataclass(frozen=True)
class DecodePriors:
    # Largest-GEMM and HBM efficiency are the hardware's priors (``Hardware.priors``, cost/hardware.py).
    # Tensor-core GEMM tile (rows = tokens, columns = output features): Hopper's wgmma works on 64-row
    # warpgroup tiles and CUTLASS/cuBLAS kernels use 64–256 × 128 tiles; a GEMM whose tiles do not fill
    # whole waves of the SMs loses the rest ("tile" and "wave quantization", NVIDIA Deep Learning
    # Performance guide, "Matrix Multiplication Background").
    tile_rows: int = 64
    tile_cols: int = 128
    # GPU kernel launches that do no useful work between kernels even inside a CUDA graph: ~2–4 µs each
    # (NVIDIA CUDA C++ Best Practices Guide, kernel launch overhead); a Llama layer runs ~10 kernels
    # (norm, QKV, rope, attention, O, add+norm, gate/up, act, down, add).
    kernel_gap_s: float = 2e-6
    kernels_per_layer: int = 10


@dataclass(frozen=True)
class Precision:
    """Weights, activations and KV cache: bf16/fp16 (2 bytes) or fp8 (1 byte, FP8 tensor-core peak)."""

    name: str
    weight_bytes: float
    kv_bytes: float

    @staticmethod
    def of(name: str) -> Precision:
        if name in ("bf16", "fp16"):
            return Precision(name, 2.0, 2.0)
        if name == "fp8":  # FP8 weights, activations and KV cache (TensorRT-LLM's FP8 recipe)
            return Precision(name, 1.0, 1.0)
        raise ValueError(f"precision {name!r}: use bf16, fp16 or fp8")


@dataclass(frozen=True)
class Replica:
    """One tensor-parallel inference replica: hardware, model, TP degree, precision and engine."""

    hw: Hardware
    arch: ModelArch
    tp: int
    precision: Precision = field(default_factory=lambda: Precision.of("bf16"))
    engine: str = "vllm"
    priors: DecodePriors = field(default_factory=DecodePriors)

    @property
    def peak_flops(self) -> float:
        gpu = self.hw.cluster.gpu
        if self.precision.name != "fp8":
            return gpu.peak_flops
        fp8 = _gpu_extras().get(gpu.name, (0.0, 0))[0]
        if fp8 <= 0:
            raise ValueError(f"{gpu.name} has no FP8 tensor cores")
        return fp8

    @property
    def sms(self) -> int:
        return _gpu_extras().get(self.hw.cluster.gpu.name, (0.0, 108))[1]

    def gemms(self) -> list[tuple[int, int, int]]:
        """(output columns per rank, inner dimension per rank, count per model) of the decoder's GEMMs:
        column-parallel QKV and gate/up, row-parallel O and down, and the vocabulary-parallel LM head."""
        a, t = self.arch, self.tp
        hd, mats = a.head_dim, 3 if a.mlp == "swiglu" else 2
        return [
            ((a.heads + 2 * a.kv_heads) * hd // t, a.hidden, a.layers),
            (a.hidden, a.heads * hd // t, a.layers),
            ((mats - 1) * a.ffn_hidden // t, a.hidden, a.layers),
            (a.hidden, a.ffn_hidden // t, a.layers),
            (a.vocab // t, a.hidden, 1),
        ]

    def kv_bytes_per_token(self) -> float:
        """KV cache per token on one rank: KV heads split over TP, replicated beyond kv_heads."""
        return self.arch.kv_bytes_per_token(1) * self.precision.kv_bytes / min(self.tp, self.arch.kv_heads)

    def weight_bytes(self) -> float:
        """Weights held per rank (embedding included: the engine keeps it resident)."""
        return self.arch.params() * self.precision.weight_bytes / self.tp


def gemm_efficiency(r: Replica, rows: int, cols: int) -> float:
    """Achieved fraction of peak for a rows × cols output: the prior for large GEMMs times the useful
    share of the tiles the GPU runs in whole waves (tile and wave quantization, see ``DecodePriors``)."""
    p = r.priors
    if rows < 1 or cols < 1:  # an empty output (a dimension smaller than the TP degree): no tiles, no work
        return r.hw.priors.gemm_efficiency
    tiles = math.ceil(rows / p.tile_rows) * math.ceil(cols / p.tile_cols)
    waves = math.ceil(tiles / r.sms)
    return r.hw.priors.gemm_efficiency * rows * cols / (waves * r.sms * p.tile_rows * p.tile_cols)


@dataclass(frozen=True)
class StepTime:
    """One decode iteration of a replica; ``terms`` in seconds, ``bound`` the larger GEMM side."""

    terms: dict[str, float]
    bound: str  # "memory" when weight reads exceed GEMM compute time, else "compute"

    @property
    def total(self) -> float:
        return sum(self.terms.values())


def step_time(r: Replica, batch: float, context: float) -> StepTime:
    """One decode iteration with ``batch`` active sequences at mean ``context`` tokens."""
    hbm = r.hw.cluster.gpu.hbm_bytes_per_s * r.hw.priors.hbm_efficiency
    b = max(1, math.ceil(batch))
    weights = compute = 0.0
    for cols, inner, count in r.gemms():
        read = cols * inner * r.precision.weight_bytes / hbm
        flops = 2 * b * cols * inner / (r.peak_flops * gemm_efficiency(r, b, cols))
        weights, compute = weights + count * read, compute + count * flops
        # Each GEMM is its own kernel: it lasts as long as the slower of its reads and its FLOPs.
    gemm = max(weights, compute)
    a = r.arch
    kv = batch * context * r.kv_bytes_per_token() / hbm
    attn_flops = 4 * batch * context * a.heads * a.head_dim * a.layers / r.tp
    attention = max(kv, attn_flops / (r.peak_flops * r.hw.priors.gemm_efficiency))
    # Two all-reduces of b·h activations per layer (attention out, MLP out), bf16 on the wire.
    comm = 2 * a.layers * r.hw.all_reduce_time(batch * a.hidden * 2, r.tp)
    eng = ENGINES[r.engine]
    fixed = eng.step_s + a.layers * r.priors.kernels_per_layer * r.priors.kernel_gap_s
    terms = {"gemm": gemm, "attention": attention, "tp_comm": comm, "per_sequence": batch * eng.sequence_s,
             "fixed": fixed}
    return StepTime(terms, "memory" if weights >= compute else "compute")


def prefill_time(r: Replica, tokens: float, prompt: float) -> float:
    """Prefill of ``tokens`` prompt tokens (prompts of ``prompt`` tokens): compute-bound GEMMs at the
    large-GEMM efficiency, causal attention (2·s²·h FLOPs per layer per prompt, halved by the mask), and
    the two all-reduces per layer of tokens·h activations."""
    a = r.arch
    gemm_flops = sum(2 * tokens * cols * inner * count for cols, inner, count in r.gemms())
    attn_flops = 2 * tokens * prompt * a.heads * a.head_dim * a.layers / r.tp
    compute = (gemm_flops + attn_flops) / (r.peak_flops * r.hw.priors.gemm_efficiency)
    return compute + 2 * a.layers * r.hw.all_reduce_time(tokens * a.hidden * 2, r.tp)


def kv_capacity_tokens(r: Replica, kv_fraction: float) -> float:
    """Tokens of KV cache one replica holds: ``kv_fraction`` of what weights and reserved memory leave."""
    free = r.hw.usable_bytes() - r.weight_bytes()
    return max(0.0, free * kv_fraction / r.kv_bytes_per_token())


@dataclass(frozen=True)
class Generation:
    """A continuously batched generation: seconds in the bulk phase (every slot busy, refilled from the
    queue), in the tail (fewer sequences left than slots: the batch drains), in prefill, and the decode
    steps that were memory- vs compute-bound."""

    bulk_s: float
    tail_s: float
    prefill_s: float
    steps: dict[str, int]
    tokens: int

    @property
    def total_s(self) -> float:
        return self.bulk_s + self.tail_s + self.prefill_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_s


def generation_time(r: Replica, prompt: int, lengths: list[int], batch: int) -> Generation:
    """Generate ``lengths`` (response tokens, in arrival order) after ``prompt``-token prompts with at
    most ``batch`` sequences in flight: a sequence that ends frees its slot for the next one in the queue
    (iteration-level scheduling), whose prefill runs before the next step. The first response token
    comes from prefill, each further one from a decode step. Step time is evaluated once per stretch of
    steps between two completions, at the stretch's mean context."""
    queue = list(reversed(lengths))
    active: list[tuple[int, int]] = []  # heap of (step it ends at, step it started at)
    starts_sum, step = 0.0, 0
    times = {"bulk": 0.0, "tail": 0.0, "prefill": 0.0}
    bounds = {"memory": 0, "compute": 0}
    while queue or active:
        admitted = 0
        while queue and len(active) < batch:
            heapq.heappush(active, (step + max(0, queue.pop() - 1), step))
            starts_sum += step
            admitted += 1
        if admitted:
            times["prefill"] += prefill_time(r, admitted * prompt, prompt)
        end, n = active[0][0], len(active)
        if end > step:
            mid = step + (end - step - 1) / 2
            st = step_time(r, n, prompt + 1 + mid - starts_sum / n)
            times["bulk" if n >= batch else "tail"] += (end - step) * st.total
            bounds[st.bound] += end - step
            step = end
        while active and active[0][0] == step:
            starts_sum -= heapq.heappop(active)[1]
    return Generation(times["bulk"], times["tail"], times["prefill"], bounds, sum(lengths))
