"""Mixture-of-Experts terms of a stage's cost: expert parameters per rank, expert load imbalance, token
dispatch/combine all-to-all, router and permutation traffic, and the experts a decode step reads.

A dense decoder has none of these (every function returns the dense value or 0 for ``arch.moe is None``),
so dense models price exactly as without this module. Expert parallelism follows Megatron-Core's
definition (NVIDIA Megatron-Core MoE docs, "Expert Parallelism"; DeepSpeed-MoE, Rajbhandari et al. 2022):
``ep`` of the data-parallel ranks split the experts, attention and the dense layers stay data parallel over
all ``dp`` ranks, so the experts' data-parallel group (gradient sync, ZeRO shards) is ``dp / ep`` ranks
``tp · ep`` apart; experts are tensor-parallel with the layout's ``tp`` (Megatron's default
expert_tensor_parallel_size = tensor_model_parallel_size).

Expert GEMMs run at the routed token count: 2 FLOPs per active parameter per token (``top_k`` experts, the
shared one, the router: ``ModelArch.active_layer_params``), which ``cost.stages`` already charges.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from nereus.cost.hardware import Hardware
from nereus.spec.layout import Layout
from nereus.spec.model import ModelArch

BF16 = 2
FP32 = 4
# Routed tokens on the busiest EP rank over the mean. A dropless MoE (Megatron-Core's default; MegaBlocks,
# Gale et al. 2022, arXiv:2211.15841) waits for its busiest expert group every layer. With a load-balancing
# loss, Switch Transformer trains at capacity factor 1.0-1.25 dropping few tokens (Fedus et al. 2021,
# arXiv:2101.03961, Sec. 2.2 and Table 1: 1.25 the default), i.e. the busiest expert stays within ~1.25x
# of the mean; DeepSeek-V3's auxiliary-loss-free balancing reports the same order per batch (Liu et al.
# 2024, arXiv:2412.19437, Sec. 2.1.2 and Fig. 9). A rank holding E/ep experts averages several of them,
# so we take 1.2: a stated prior, not fitted to any row. Without EP every rank computes its own tokens'
# experts and nothing waits.
EP_RANK_IMBALANCE = 1.2
# Fixed cost of one all-to-all call (NCCL's grouped send/recv launch and handshake), as a TP all-reduce
# call is charged in ``cost.decode.DecodePriors.all_reduce_call_s``.
ALL_TO_ALL_CALL_S = 10e-6
# HBM traffic of a sparse layer per routed token copy, besides the GEMMs: the permutation gathers each
# token's hidden state into its experts' order and the un-permutation scatters it back, each a read and
# a write of h bf16 values (Megatron-Core token_dispatcher permute/unpermute).
PERMUTE_TRAFFIC = 4
# Kernels a sparse layer's MLP launches per decode step beyond a dense MLP's three (gate/up GEMM, activation,
# down GEMM). vLLM's fused-MoE path (vllm/model_executor/layers/fused_moe: ``FusedMoE.forward`` →
# ``select_experts`` → ``fused_experts_impl``; SGLang's fused_moe_triton is the same sequence) runs the router
# GEMM, the top-k softmax, the top-k renormalisation (sum and divide, Qwen3's norm_topk_prob), the
# token-to-block alignment (``moe_align_block_size`` and the fill of its index buffer), the gate/up
# grouped GEMM (Triton), the activation, the down grouped GEMM (Triton) and the sum over the k experts:
# ten kernels for the dense MLP's three. Each costs a replayed graph's kernel gap, and run eagerly a host
# dispatch (``cost.eager``).
MOE_MLP_EXTRA_KERNELS = 7
# Kernels a sparse layer's shared expert adds to a decode step: its gate/up GEMM, the activation, its down GEMM
# and the add of its output to the routed experts' (vLLM's DeepseekV2MoE and Qwen2MoeSparseMoeBlock run the
# shared expert as a dense MLP of its own beside the fused-MoE call).
SHARED_EXPERT_KERNELS = 4


def decode_kernels_per_layer(layers: int, sparse_layers: int, dense_kernels: int, shared_expert: bool = False) -> float:
    """Kernels a decode step launches per layer on average over the layers: ``dense_kernels`` in a dense
    layer, ``MOE_MLP_EXTRA_KERNELS`` more in a sparse one, and ``SHARED_EXPERT_KERNELS`` more where a sparse
    layer has a shared expert."""
    extra = MOE_MLP_EXTRA_KERNELS + (SHARED_EXPERT_KERNELS if shared_expert else 0)
    return dense_kernels + extra * sparse_layers / layers


def imbalance(arch: ModelArch, ep: int) -> float:
    """The factor on expert time of the busiest rank: ``EP_RANK_IMBALANCE`` under expert parallelism."""
    return EP_RANK_IMBALANCE if arch.moe is not None and ep > 1 else 1.0


@lru_cache(maxsize=256)
def expert_layer_params(arch: ModelArch) -> float:
    """Routed-expert parameters of one layer on average over the layers (all experts; 0 for a dense model)."""
    if arch.moe is None:
        return 0.0
    return arch.sparse_layers() * arch.moe.experts * arch.moe.expert_params(arch.hidden) / arch.layers


def routed_expert_flops_per_token(arch: ModelArch) -> float:
    """Forward FLOPs of one token's routed experts on average over the layers (2 per active expert weight)."""
    if arch.moe is None:
        return 0.0
    return 2 * arch.sparse_layers() * arch.moe.top_k * arch.moe.expert_params(arch.hidden) / arch.layers


def experts_hit(experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts ``tokens`` routed tokens reach: each draws ``top_k`` of ``experts``; an
    expert is missed by one token with probability 1 − k/E, so E·(1 − (1 − k/E)^tokens) are hit (uniform
    routing; skewed routing hits fewer, so this is the upper end of the reads)."""
    if tokens <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def all_to_all_time(hw: Hardware, nbytes: float, ep: int, stride: int) -> float:
    """One all-to-all in which each rank sends ``nbytes`` spread evenly over the ``ep`` ranks of its group
    (``stride`` GPUs apart): the (ep−1)/ep leaving the rank cross NVLink to peers in its node and the
    node's NICs (one per GPU) to the others, both at once. The sends to all peers are issued together
    (NCCL grouped send/recv), so latency is one link step plus a small issue cost per peer, and the call.
    Check against DeepEP's published decode kernels (deepseek-ai/DeepEP README, "Low-latency kernels":
    128 tokens, hidden 7168, top-8, H800 + 400 Gb/s RDMA): dispatch (FP8) 173 µs and combine (BF16) 314 µs
    at EP 64; this model gives 0.24 ms and 0.40 ms for the same bytes (NCCL is not DeepEP)."""
    if ep <= 1:
        return 0.0
    gpn = hw.cluster.gpus_per_node
    per_peer = nbytes / ep
    in_node = min(ep, max(1, gpn // stride)) if stride < gpn else 1
    p, gpu = hw.priors, hw.cluster.gpu
    intra = (in_node - 1) * per_peer / (gpu.intra_node_bytes_per_s * p.intra_link_efficiency)
    inter = (ep - in_node) * per_peer / (gpu.inter_node_bytes_per_s * p.inter_link_efficiency)
    latency = (p.inter_latency_s if ep > in_node else p.intra_latency_s) + (ep - 1) * p.intra_latency_s
    return max(intra, inter) + latency + ALL_TO_ALL_CALL_S


@dataclass(frozen=True)
class MoEPass:
    """What a forward pass over one micro-batch adds per layer (on average over the layers) and device."""

    extra_flops: float  # the busiest rank's expert FLOPs beyond the mean (imbalance)
    hbm_bytes: float  # permutation and router traffic
    ep_comm_s: float  # dispatch + combine all-to-all


def moe_pass(hw: Hardware, arch: ModelArch, layout: Layout, tokens: float) -> MoEPass:
    """One forward pass of ``tokens`` tokens of a micro-batch through a layer: a dense model adds nothing."""
    if arch.moe is None:
        return MoEPass(0.0, 0.0, 0.0)
    m, h, t = arch.moe, arch.hidden, layout.tp
    share = arch.sparse_layers() / arch.layers
    rank_tokens = tokens / t  # Megatron's MoE under TP runs sequence parallel: each TP rank routes 1/t
    expert_flops = rank_tokens * routed_expert_flops_per_token(arch)
    extra = (imbalance(arch, layout.ep) - 1.0) * expert_flops
    # router logits, softmax and top-k over every expert in fp32, read and written once each
    router = 2 * rank_tokens * m.experts * FP32
    permute = PERMUTE_TRAFFIC * rank_tokens * m.top_k * h * BF16
    hbm = share * (router + permute)
    # dispatch sends each token's hidden state to its k experts' ranks, combine returns the outputs
    a2a = 2 * all_to_all_time(hw, rank_tokens * m.top_k * h * BF16, layout.ep, t) * imbalance(arch, layout.ep)
    return MoEPass(extra, hbm, share * a2a)


@dataclass(frozen=True)
class ParamPart:
    """Parameters of the fullest device that share one data-parallel group: the dense part over all ``dp``
    ranks, the experts over ``dp / ep`` ranks ``stride`` apart (``layout`` carries that group's dp)."""

    params: float
    layout: Layout
    stride: int


def param_parts(arch: ModelArch, layout: Layout, stage_params: float) -> tuple[ParamPart, ...]:
    """``stage_params`` (the fullest device's parameters, ``cost.memory.stage_params``) split by the
    data-parallel group that syncs and shards them; a dense model has one part."""
    if arch.moe is None or layout.ep <= 1:
        return (ParamPart(stage_params, layout, layout.tp),)
    layers = math.ceil(arch.layers / layout.pp)  # the fullest stage's, as cost.memory.stage_layers
    experts = layers * expert_layer_params(arch) / (layout.tp * layout.ep)
    expert_dp = replace(layout, dp=max(1, layout.dp // layout.ep))
    return (ParamPart(stage_params - experts, layout, layout.tp),
            ParamPart(experts, expert_dp, layout.tp * layout.ep))


def expert_params_per_rank(arch: ModelArch, tp: int, ep: int) -> float:
    """Routed-expert parameters of one layer (mean over layers) that expert parallelism takes off a rank."""
    return expert_layer_params(arch) / tp * (1 - 1 / ep)


def moe_micro_batch_terms(hw: Hardware, arch: ModelArch, layout: Layout, tokens: float, layers: int,
                          training: bool) -> dict[str, float]:
    """Seconds one micro-batch adds on the fullest pipeline stage's ``layers``: the imbalance's extra expert
    FLOPs (``compute``), permutation and router traffic (``memory``) and the all-to-alls (``ep_comm``).
    Training runs them in forward and backward (2x the FLOPs, the same all-to-alls mirrored: Megatron-Core
    token dispatcher), and a full recompute once more. Empty for a dense model."""
    if arch.moe is None:
        return {}
    full = training and layout.recompute == "full"
    return dict(_micro_batch_terms(hw, arch, layout.tp, layout.ep, tokens, layers, training, full))


@lru_cache(maxsize=65536)  # the planner prices the same degrees and micro-batches under many other options
def _micro_batch_terms(hw: Hardware, arch: ModelArch, tp: int, ep: int, tokens: float, layers: int,
                       training: bool, full_recompute: bool) -> tuple[tuple[str, float], ...]:
    one = moe_pass(hw, arch, Layout(tp=tp, ep=ep), tokens)
    again = 1 if full_recompute else 0
    flops_passes, comm_passes = (3 + again, 2 + again) if training else (1, 1)
    return (("compute", hw.compute_time(layers * flops_passes * one.extra_flops)),
            ("memory", hw.hbm_time(layers * flops_passes * one.hbm_bytes)),
            ("ep_comm", layers * comm_passes * one.ep_comm_s))


@dataclass(frozen=True)
class ExpertDecode:
    """The routed experts of one inference replica in a decode step of ``b`` sequences (per rank). The
    replica reads only the experts its batch hits (``experts_hit``; with ``ep`` replicas sharing them, the
    experts of this rank that the group's ``b · ep`` tokens hit), so memory-bound decode at a small batch
    reads a few experts, not all of them. The expert GEMMs run grouped, each hit expert on the tokens routed
    to it: few rows each, so tile quantization costs more than in a dense GEMM of the batch."""

    sparse_layers: int
    experts: int
    top_k: int
    ep: int
    expert_read_s: float  # one expert's weight shard read from HBM
    shapes: tuple[tuple[int, int], ...]  # (output columns, inner) per rank of the gate/up and down GEMMs
    flop_s: float  # peak FLOP/s times the large-GEMM efficiency
    sms: int
    tile_rows: int
    tile_cols: int
    imbalance: float

    def read_s(self, b: float) -> float:
        hit = experts_hit(self.experts, self.top_k, max(1.0, b) * self.ep) / self.ep
        return self.sparse_layers * hit * self.expert_read_s

    def compute_s(self, b: float) -> float:
        tokens = max(1.0, b) * self.ep
        hit = experts_hit(self.experts, self.top_k, tokens)
        rows = tokens * self.top_k / hit  # tokens per hit expert
        groups = math.ceil(hit / self.ep)
        seconds = 0.0
        for cols, inner in self.shapes:
            flops = 2 * max(1.0, b) * self.top_k * cols * inner * self.imbalance
            seconds += flops / (self.flop_s * self._efficiency(rows, cols, groups))
        return self.sparse_layers * seconds

    def _efficiency(self, rows: float, cols: int, groups: int) -> float:
        """Useful share of the tiles a grouped GEMM of ``groups`` experts runs in whole waves of the SMs."""
        r = max(1, math.ceil(rows))
        tile_rows = min(self.tile_rows, max(8, 1 << (r - 1).bit_length()))
        tiles = groups * math.ceil(r / tile_rows) * math.ceil(cols / self.tile_cols)
        waves = math.ceil(tiles / self.sms)
        return min(1.0, groups * rows * cols / (waves * self.sms * tile_rows * self.tile_cols))

    def all_to_all_s(self, hw: Hardware, hidden: int, tp: int, batch: float) -> float:
        """Dispatch and combine of ``batch`` sequences' tokens over the EP group, every sparse layer."""
        return 2 * self.sparse_layers * all_to_all_time(hw, batch * self.top_k * hidden * BF16, self.ep, tp)


def expert_decode(hw: Hardware, arch: ModelArch, tp: int, ep: int, weight_bytes: float, peak: float,
                  efficiency: float, sms: int, tile_rows: int, tile_cols: int) -> ExpertDecode | None:
    """The routed experts of a decode replica (None for a dense model)."""
    if arch.moe is None:
        return None
    m, h = arch.moe, arch.hidden
    hbm = hw.cluster.gpu.hbm_bytes_per_s * hw.priors.hbm_efficiency
    read = m.expert_params(h) * weight_bytes / tp / hbm
    shapes = ((2 * m.expert_ffn_hidden // tp, h), (h, m.expert_ffn_hidden // tp))
    return ExpertDecode(arch.sparse_layers(), m.experts, m.top_k, ep, read, shapes, peak * efficiency, sms,
                        tile_rows, tile_cols, imbalance(arch, ep))


def non_expert_mlp_gemms(arch: ModelArch, tp: int) -> list[tuple[int, int, int]]:
    """(output columns, inner, count) per rank of an MoE decoder's MLP GEMMs besides the routed experts: the
    dense layers' MLPs, the shared experts, the routers (replicated over TP)."""
    assert arch.moe is not None
    m, h, dense = arch.moe, arch.hidden, len(arch.moe.dense_layers)
    sparse = arch.sparse_layers()
    out = [(2 * arch.ffn_hidden // tp, h, dense), (h, arch.ffn_hidden // tp, dense),
           (2 * m.shared_expert_ffn_hidden // tp, h, sparse), (h, m.shared_expert_ffn_hidden // tp, sparse),
           (m.experts, h, sparse)]
    return [g for g in out if g[0] > 0 and g[1] > 0 and g[2] > 0]
