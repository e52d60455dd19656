"""Decode (generation) time of one inference-engine replica: per-step roofline and continuous batching.

Validated against published TensorRT-LLM and vLLM figures (``decode_published.csv``, package data;
``tests/cost/test_decode_published.py``); ``nereus.cost.stages`` prices every generation model-stage with
``decode_phases`` (the analytic form of ``cost.decode_events.generation_time`` the planner can afford).

One decode step of a tensor-parallel replica (Pope et al. 2022, "Efficiently Scaling Transformer
Inference", Sec. 2–3) costs, per layer, each GEMM's max(weight shard read, FLOPs at an efficiency set by
tile and wave quantization of the shard), the KV-cache read of every active sequence at its current
context, two all-reduces of b·h activations (Shoeybi et al. 2019), plus the engine's fixed cost per step
and its cost per active sequence. A generation runs a bulk phase at the engine's batch, slots refilling as
sequences end (Yu et al. 2022, "Orca", iteration-level scheduling), then a tail as the batch drains.
"""

from __future__ import annotations

import bisect
import csv
import math
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources

from nereus.cost.hardware import Hardware
from nereus.cost.moe import (
    decode_kernels_per_layer,
    expert_decode,
    expert_params_per_rank,
    imbalance,
    non_expert_mlp_gemms,
    routed_expert_flops_per_token,
)
from nereus.spec.engines import PRICING_ENGINE, EngineCosts, engine_traits
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


MIN_TILE_ROWS = 8  # see DecodePriors.tile_rows


@dataclass(frozen=True)
class DecodePriors:
    # Largest-GEMM and HBM efficiency are the hardware's priors (``Hardware.priors``, cost/hardware.py).
    # Tensor-core GEMM tile (rows = tokens, columns = output features): Hopper's wgmma works on 64-row
    # warpgroup tiles and CUTLASS/cuBLAS kernels use 64–256 × 128 tiles; a GEMM whose tiles do not fill
    # whole waves of the SMs loses the rest ("tile" and "wave quantization", NVIDIA Deep Learning
    # Performance guide, "Matrix Multiplication Background").
    tile_rows: int = 64
    # Kernel libraries pick the tile from a menu by problem size: a batch of a few sequences runs on
    # tiles only as tall as it needs, down to the 8 rows of the smallest tensor-core instruction
    # (mma.sync m16n8k16, with the batch as its 8-wide operand; NVIDIA PTX ISA, "Matrix shape"), so
    # batch-1 decode is not charged 64 rows of FLOPs (it is memory-bound on every GPU, H20 included).
    tile_cols: int = 128
    # A short kernel costs ~3 µs even replayed from a CUDA graph (NVIDIA Technical Blog, "Getting Started
    # with CUDA Graphs", 2019: 3.4 µs per kernel from a graph, 3.8 µs launched back to back); a Llama layer
    # runs ~10 kernels (norm, QKV, rope, attention, O, add+norm, gate/up, act, down, add). Was 2 µs: at
    # 3 µs the 13 validated small-batch rows (``decode_small_batch.csv``) go from 9.3% to 6.0% mean error.
    kernel_gap_s: float = 3e-6
    kernels_per_layer: int = 10
    # Each TP all-reduce is its own kernel ending in a barrier across the group: a few µs per call on
    # top of the ring's per-step latency for decode-sized messages. Both engines use one-shot custom
    # all-reduce kernels for small messages because NCCL's own small all-reduce costs more than that
    # (vLLM, vllm/distributed/device_communicators/custom_all_reduce.py; TensorRT-LLM's custom
    # AllReduce plugin); 5 µs is the order of a cross-GPU flag handshake plus a launch.
    all_reduce_call_s: float = 5e-6
    # FP8 GEMMs reach a smaller share of their (twice as high) peak than BF16 ones. Like the BF16 prior
    # this is the large-GEMM efficiency (small batches lose more through tile and wave quantization):
    # DeepGEMM, a hand-tuned Hopper FP8 library, measured its six dense M = 4096 shapes at 1058, 990,
    # 590, 1358, 1304 and 1025 TFLOPS on H800 (deepseek-ai/DeepGEMM README at its first release,
    # "Normal GEMMs for dense models"; "1350+" is only its best shape): mean 1054, 0.53 of the 1,979
    # TFLOPS dense FP8 peak of an H100/H800 SXM.
    fp8_gemm_efficiency: float = 0.53
    # TP all-reduces of decode-sized messages (b·h activations, ~0.5–32 MB) reach only part of the bus
    # bandwidth NCCL reaches on large ones, which ``Priors.intra_link_efficiency`` describes (0.8 of the
    # link: 360 GB/s on H100). nccl-tests all_reduce_perf on 8×H100 (AWS p5;
    # aws-samples/awsome-distributed-training, 1.architectures/3.aws-batch/README.md) took 55.4, 84.3
    # and 124.0 µs at 4, 8 and 16 MB: after the fixed cost charged apart (14 ring steps × 1 µs + the
    # 5 µs call) that is 201, 225 and 280 GB/s of bus bandwidth (2(n−1)/n of the bytes), mean 235 GB/s,
    # 0.65 of 360 (the same run reaches 440–480 GB/s at 1–16 GB). The share scales a measured profile's
    # link rate alike.
    decode_link_share: float = 0.65


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
    engine: str = PRICING_ENGINE  # a name or alias of ``spec.engines.ENGINE_TRAITS``
    priors: DecodePriors = field(default_factory=DecodePriors)
    # The engine's host costs; None: its declared ones (``EngineTraits.host``, with their sources). The cost
    # model passes the cluster's ``decode_step_overhead_s`` prior here, so a measured profile overrides the
    # engine's fixed step cost.
    engine_costs: EngineCosts | None = None
    # replicas whose routed experts are split over ``ep`` of them (expert parallelism, ``cost.moe``)
    ep: int = 1

    @property
    def costs(self) -> EngineCosts:
        if self.engine_costs is not None:
            return self.engine_costs
        host = engine_traits(self.engine).host
        if host is None:
            raise ValueError(f"engine {self.engine!r} declares no host costs: give engine_costs")
        return host

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
    def gemm_efficiency(self) -> float:
        """Large-GEMM efficiency: the hardware's prior for BF16/FP16, ``DecodePriors`` for FP8."""
        if self.precision.name == "fp8":
            return self.priors.fp8_gemm_efficiency
        return self.hw.priors.gemm_efficiency

    @property
    def sms(self) -> int:
        return _gpu_extras().get(self.hw.cluster.gpu.name, (0.0, 108))[1]

    def gemms(self) -> list[tuple[int, int, int]]:
        """(output columns per rank, inner dimension per rank, count per model) of the decoder's GEMMs:
        column-parallel QKV and gate/up, row-parallel O and down, and the vocabulary-parallel LM head."""
        a, t = self.arch, self.tp
        hd, mats = a.head_dim, 3 if a.mlp == "swiglu" else 2
        mlp = ([((mats - 1) * a.ffn_hidden // t, a.hidden, a.layers), (a.hidden, a.ffn_hidden // t, a.layers)]
               if a.moe is None else non_expert_mlp_gemms(a, t))  # routed experts: ``StepModel.experts``
        return [
            ((a.heads + 2 * a.kv_heads) * hd // t, a.hidden, a.layers),
            (a.hidden, a.heads * hd // t, a.layers),
            *mlp,
            (a.vocab // t, a.hidden, 1),
        ]

    def lm_head_bytes(self) -> float:
        """Bytes per weight of the embedding and the LM head: 16-bit even in FP8 engines (NVIDIA
        ModelOpt's FP8_DEFAULT_CFG disables the ``*lm_head*`` quantizer and quantizes only linear layers,
        modelopt/torch/quantization/config.py, ``_default_disabled_quantizer_cfg``)."""
        return max(2.0, self.precision.weight_bytes)

    def lm_head_peak(self) -> tuple[float, float]:
        """Peak FLOP/s and large-GEMM efficiency of the LM head's GEMM (16-bit: ``lm_head_bytes``)."""
        if self.precision.name == "fp8":
            return self.hw.cluster.gpu.peak_flops, self.hw.priors.gemm_efficiency
        return self.peak_flops, self.gemm_efficiency

    def kv_bytes_per_token(self) -> float:
        """KV cache per token on one rank: KV heads split over TP, replicated beyond kv_heads."""
        return self.arch.kv_bytes_per_token(1) * self.precision.kv_bytes / min(self.tp, self.arch.kv_heads)

    def weight_bytes(self) -> float:
        """Weights held per rank (embedding included: the engine keeps it resident; embedding and LM
        head at ``lm_head_bytes``)."""
        a = self.arch
        vocab = a.embedding_params() + (0 if a.tied_embeddings else a.vocab * a.hidden)
        body = a.params() - vocab - (a.layers * expert_params_per_rank(a, 1, self.ep) if self.ep > 1 else 0)
        return (body * self.precision.weight_bytes + vocab * self.lm_head_bytes()) / self.tp


def _weights(gemms: list[tuple[int, int, int]]) -> int:
    return sum(cols * inner * count for cols, inner, count in gemms)


def gemm_efficiency(r: Replica, rows: int, cols: int) -> float:
    """Achieved fraction of peak for a rows × cols output: the prior for large GEMMs times the useful
    share of the tiles the GPU runs in whole waves (tile and wave quantization, see ``DecodePriors``)."""
    p = r.priors
    return _quantized_efficiency(r.gemm_efficiency, r.sms, p.tile_rows, p.tile_cols, rows, cols)


def _quantized_efficiency(prior: float, sms: int, tile_rows: int, tile_cols: int, rows: int, cols: int) -> float:
    if rows < 1 or cols < 1:  # an empty output (a dimension smaller than the TP degree): no tiles, no work
        return prior
    # A few rows run on a tile just tall enough for them (see ``DecodePriors.tile_rows``).
    tile_rows = min(tile_rows, max(MIN_TILE_ROWS, 1 << (rows - 1).bit_length()))
    tiles = math.ceil(rows / tile_rows) * math.ceil(cols / tile_cols)
    waves = math.ceil(tiles / sms)
    return prior * rows * cols / (waves * sms * tile_rows * tile_cols)


@lru_cache(maxsize=65536)
def _gemm_compute_s(gemms: tuple[tuple[int, int, int], ...], peak: float, prior: float, sms: int,
                    tile_rows: int, tile_cols: int, b: int) -> float:
    """Seconds of a decode step's GEMM FLOPs at ``b`` rows (cached: the planner asks for the same
    shapes and batches again and again)."""
    return sum(count * 2 * b * cols * inner / (peak * _quantized_efficiency(prior, sms, tile_rows, tile_cols, b, cols))
               for cols, inner, count in gemms)


@dataclass(frozen=True)
class StepTime:
    """One decode iteration of a replica; ``terms`` in seconds, ``bound`` the larger GEMM side."""

    terms: dict[str, float]
    bound: str  # "memory" when weight reads exceed GEMM compute time, else "compute"

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    def by_kind(self) -> dict[str, float]:
        """The step's seconds under the cost model's term names (``nereus.cost.stages.TERMS``): weight
        and KV reads are ``memory``, FLOP-bound GEMMs ``compute``, engine costs ``overhead``."""
        t = self.terms
        out = {"compute": 0.0, "memory": t["attention"], "tp_comm": t["tp_comm"],
               "overhead": t["per_sequence"] + t["fixed"]}
        out[self.bound] += t["gemm"]
        return out


def all_reduce_call(r: Replica, nbytes: float) -> float:
    """One TP all-reduce of ``nbytes``: the ring's latency and bandwidth terms plus the call's own cost."""
    if r.tp <= 1:
        return 0.0
    return r.priors.all_reduce_call_s + r.hw.all_reduce_time(nbytes, r.tp)


class StepModel:
    """A replica's decode-step cost with everything that does not depend on the batch worked out once
    (``step_time`` for one step; ``decode_phases`` evaluates many)."""

    def __init__(self, r: Replica) -> None:
        hw, a = r.hw, r.arch
        hbm = hw.cluster.gpu.hbm_bytes_per_s * hw.priors.hbm_efficiency
        self.replica, self.peak = r, r.peak_flops
        self.gemm_list = r.gemms()
        body, head = self.gemm_list[:-1], self.gemm_list[-1:]
        self.weights_s = (_weights(body) * r.precision.weight_bytes + _weights(head) * r.lm_head_bytes()) / hbm
        self.kv_s_per_token = r.kv_bytes_per_token() / hbm
        self.attn_s_per_token = 4 * a.heads * a.head_dim * a.layers / r.tp / (self.peak * r.gemm_efficiency)
        # Two all-reduces of b·h bf16 activations per layer (attention out, MLP out), Shoeybi et al. 2019;
        # ring all-reduce time is linear in the bytes: latency + bytes / bandwidth.
        self.comm_fixed = 2 * a.layers * all_reduce_call(r, 0.0)
        self.comm_per_seq = 2 * a.layers * (hw.all_reduce_time(a.hidden * 2.0, r.tp)
                                            - hw.all_reduce_time(0.0, r.tp)) / r.priors.decode_link_share
        self.experts = expert_decode(hw, a, r.tp, r.ep, r.precision.weight_bytes, self.peak, r.gemm_efficiency,
                                     r.sms, r.priors.tile_rows, r.priors.tile_cols)
        if self.experts is not None and r.ep > 1:  # dispatch/combine all-to-alls: linear in the batch too
            fixed = self.experts.all_to_all_s(hw, a.hidden, r.tp, 0.0)
            self.comm_fixed += fixed
            self.comm_per_seq += self.experts.all_to_all_s(hw, a.hidden, r.tp, 1.0) - fixed
        eng = r.costs
        self.per_seq_s = eng.sequence_s
        shared = a.moe is not None and a.moe.shared_expert_ffn_hidden > 0
        kernels = decode_kernels_per_layer(a.layers, a.sparse_layers(), r.priors.kernels_per_layer, shared)
        self.fixed_s = eng.step_s + a.layers * kernels * r.priors.kernel_gap_s
        self._compute: dict[int, float] = {}  # compute_s by batch (a pure function of it)

    def compute_s(self, b: int) -> float:
        """GEMM FLOP time at ``b`` rows (each GEMM at its tile- and wave-quantized efficiency; the LM
        head at 16-bit peak and efficiency, see ``Replica.lm_head_bytes``)."""
        if b not in self._compute:
            self._compute[b] = self._gemm_s(b)
        return self._compute[b]

    def _gemm_s(self, b: int) -> float:
        r, p = self.replica, self.replica.priors
        body, head = tuple(self.gemm_list[:-1]), tuple(self.gemm_list[-1:])
        head_peak, head_eff = r.lm_head_peak()
        experts = self.experts.compute_s(b) if self.experts is not None else 0.0
        return (_gemm_compute_s(body, self.peak, r.gemm_efficiency, r.sms, p.tile_rows, p.tile_cols, b)
                + _gemm_compute_s(head, head_peak, head_eff, r.sms, p.tile_rows, p.tile_cols, b) + experts)

    def read_s(self, b: int) -> float:
        """Weight bytes a step of ``b`` sequences reads, in seconds: all of a dense model's; of an MoE
        model, everything but the routed experts plus the experts the batch hits (``cost.moe``)."""
        return self.weights_s if self.experts is None else self.weights_s + self.experts.read_s(b)

    def kinds(self, batch: float, context: float) -> tuple[tuple[str, float], ...]:
        """The step's seconds other than its GEMMs, under the cost model's term names."""
        return (("memory", batch * context * max(self.kv_s_per_token, self.attn_s_per_token)),
                ("tp_comm", self.comm_fixed + batch * self.comm_per_seq if self.comm_fixed else 0.0),
                ("overhead", batch * self.per_seq_s + self.fixed_s))

    def step(self, batch: float, context: float) -> StepTime:
        compute = self.compute_s(max(1, math.ceil(batch)))
        reads = self.read_s(max(1, math.ceil(batch)))
        # Each GEMM kernel lasts as long as the slower of its reads and its FLOPs; summed over the step's
        # GEMMs, the larger side sets the time (they cross at the same batch for every decoder GEMM).
        gemm = max(reads, compute)
        attention = batch * context * max(self.kv_s_per_token, self.attn_s_per_token)
        terms = {"gemm": gemm, "attention": attention,
                 "tp_comm": self.comm_fixed + batch * self.comm_per_seq if self.comm_fixed else 0.0,
                 "per_sequence": batch * self.per_seq_s, "fixed": self.fixed_s}
        return StepTime(terms, "memory" if reads >= compute else "compute")


@lru_cache(maxsize=256)
def step_model(r: Replica) -> StepModel:
    """One ``StepModel`` per replica (the planner prices the same replicas' decode phases again and again)."""
    return StepModel(r)


def step_time(r: Replica, batch: float, context: float) -> StepTime:
    """One decode iteration with ``batch`` active sequences at mean ``context`` tokens: weight reads vs
    GEMM FLOPs, KV-cache reads, two all-reduces per layer, the engine's per-sequence and fixed costs."""
    return StepModel(r).step(batch, context)


def prefill_time(r: Replica, tokens: float, prompt: float) -> float:
    """Prefill of ``tokens`` prompt tokens (prompts of ``prompt`` tokens): compute-bound GEMMs at the
    large-GEMM efficiency, causal attention (2·s²·h FLOPs per layer per prompt, halved by the mask), and
    the two all-reduces per layer of tokens·h activations."""
    a, gemms = r.arch, r.gemms()
    attn_flops = 2 * tokens * prompt * a.heads * a.head_dim * a.layers / r.tp
    head_peak, head_eff = r.lm_head_peak()
    compute = ((2 * tokens * _weights(gemms[:-1]) + attn_flops) / (r.peak_flops * r.gemm_efficiency)
               + 2 * tokens * _weights(gemms[-1:]) / (head_peak * head_eff))
    if a.moe is not None:  # the routed experts' FLOPs at the large-GEMM efficiency (prompts fill the tiles)
        routed = tokens * a.layers * routed_expert_flops_per_token(a) / r.tp * imbalance(a, r.ep)
        compute += routed / (r.peak_flops * r.gemm_efficiency)
    return compute + 2 * a.layers * all_reduce_call(r, tokens * a.hidden * 2)


def kv_capacity_tokens(r: Replica, kv_fraction: float) -> float:
    """Tokens of KV cache one replica holds: ``kv_fraction`` of what weights and reserved memory leave."""
    free = r.hw.usable_bytes() - r.weight_bytes()
    return max(0.0, free * kv_fraction / r.kv_bytes_per_token())


@dataclass(frozen=True)
class DecodePhases:
    """One replica's generation under continuous batching, in closed form (``decode_phases``).

    ``drain`` is the tail as (seconds since the tail began at the segment's end, sequences live in the
    segment), in order; ``terms`` are the decode and prefill seconds under the cost model's term names.
    """

    batch: int  # sequences in flight in the bulk phase (the engine's slots, or every sequence if fewer)
    sequences: int  # sequences this replica generates in the step
    prefill_s: float
    bulk_s: float
    tail_s: float
    bulk_steps: float
    tail_steps: float
    regime: str  # "memory" or "compute": the bound of a decode step at the bulk batch
    bulk_step_s: float  # seconds per decode step (one token per live sequence) at the bulk batch
    tail_step_s: float  # seconds per decode step with one sequence left (the tail's latency floor)
    drain: tuple[tuple[float, float], ...]
    terms: dict[str, float]

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.bulk_s + self.tail_s

    def time_at_live(self, k: float) -> float:
        """Seconds from the stage's start until at most ``k`` sequences are still generating: 0 when
        ``k`` is at least the bulk batch, the end of the stage when ``k`` < 1 (prefill counted first)."""
        if k >= self.batch:
            return 0.0
        start, before = self.prefill_s + self.bulk_s, 0.0
        for end, live in self.drain:
            if live <= k:
                return start + before
            before = end
        return self.total_s


@lru_cache(maxsize=1024)
def _segments(q: tuple[float, ...], longest: float, mix: float) -> tuple[tuple[float, float, float], ...]:
    """(steps, share of the slots live, tokens generated so far) per stretch between two quantiles.

    A slot's sequence is live at x tokens into the tail with probability (1 − mix)·S(x) + mix·S_R(x):
    S for sequences that started with the tail (every sequence at once), S_R(x) = ∫ₓ^∞ S(u) du / E[L]
    (the equilibrium residual of a renewal process: each slot refilled as its sequence ended). S is
    constant and S_R linear between quantiles, so each stretch's mean share is exact."""
    k, total = len(q), sum(q)
    above = [0.0] * (k + 1)  # above[i]: sum of q[i:]
    for i in range(k - 1, -1, -1):
        above[i] = above[i + 1] + q[i]

    def residual(x: float) -> float:  # Σ max(0, v − x) / Σ v over the sorted quantiles
        i = bisect.bisect_right(q, x)
        return (above[i] - x * (k - i)) / total

    out, last = [], 0.0
    for end in (*q, max(longest, q[-1])):
        if end <= last:
            continue
        step_share = (k - bisect.bisect_left(q, end)) / k
        share = (1 - mix) * step_share + mix * (residual(last) + residual(end)) / 2
        out.append((end - last, share, (last + end) / 2))
        last = end
    return tuple(out)


def decode_phases(r: Replica, prompt: float, sequences: int, slots: int, lengths: tuple[float, ...],
                  mean: float, longest: float) -> DecodePhases:
    """Generate ``sequences`` responses with at most ``slots`` in flight: ``lengths`` are equally
    weighted quantiles of the response length, ``mean`` its mean, ``longest`` the step's longest.

    Bulk: every slot busy, refilled from the queue (Orca's iteration-level scheduling), for the tokens
    the tail does not generate, at the steady-state context (prompt + the mean age of a sequence in
    flight, E[L²]/2E[L]). Tail: once the queue is empty the sequences in flight drain (``_segments``:
    remaining lengths follow the equilibrium residual when the queue held at least one more batch, the
    length distribution itself when every sequence started at once, a mix in between); the longest
    response runs alone to the end. ``cost.decode_events.generation_time`` is the exact event simulation it
    stands for."""
    n = max(1, sequences)
    b = max(1, min(slots, n))
    q = tuple(sorted(lengths))
    mix = min(1.0, (n - b) / b)  # share of the tail population that started after a refill
    mean_age = sum(x * x for x in q) / (2 * sum(q))
    terms = dict.fromkeys(("compute", "memory", "tp_comm", "overhead"), 0.0)
    drain: list[tuple[float, float]] = []
    bulk_s = bulk_steps = tail_s = tail_steps = tail_tokens = 0.0
    model = step_model(r)
    for steps, share, done in _segments(q, longest, mix):
        live = max(1.0, b * share)
        compute = model.compute_s(max(1, math.ceil(live)))
        reads = model.read_s(max(1, math.ceil(live)))
        gemm = max(reads, compute)
        kinds = model.kinds(live, prompt + done + mix * mean_age)
        terms["memory" if reads >= compute else "compute"] += steps * gemm
        for kind, v in kinds:
            terms[kind] += steps * v
        seconds = steps * (gemm + sum(v for _, v in kinds))
        tail_tokens += steps * live
        if live >= b:  # every slot still busy (sequences that all started at once, before any ends)
            bulk_s, bulk_steps = bulk_s + seconds, bulk_steps + steps
            continue
        tail_s, tail_steps = tail_s + seconds, tail_steps + steps
        drain.append((tail_s, live))
    refill_steps = max(0.0, n * mean - tail_tokens) / b
    bulk = model.step(b, prompt + mean_age)
    for kind, v in bulk.by_kind().items():
        terms[kind] += refill_steps * v
    # Sequences admitted into freed slots are prefilled at the step they join: one prefill pass per
    # step in which some slot refilled, each paying the all-reduce calls' fixed cost once.
    refills = min(float(n - b), refill_steps + bulk_steps)
    prefill = prefill_time(r, n * prompt, prompt) + refills * 2 * r.arch.layers * all_reduce_call(r, 0.0)
    terms["compute"] += prefill
    return DecodePhases(b, n, prefill, bulk_s + refill_steps * bulk.total, tail_s, bulk_steps + refill_steps,
                        tail_steps, bulk.bound, bulk.total, model.step(1, prompt + longest / 2).total,
                        tuple(drain), terms)
