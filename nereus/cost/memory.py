"""Per-device memory of a model-stage: weights, gradients, optimizer state, activations, KV cache.

Activation formulas are Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv 2205.05198), Table 2 and Sec. 4: per layer and micro-batch, with s = sequence length,
b = micro-batch size, h = hidden, a = heads, t = tensor-parallel size, in bytes (16-bit activations):
    no parallelism            s·b·h·(34 + 5·a·s/h)
    tensor parallel           s·b·h·(10 + 24/t + 5·a·s/(h·t))
    tensor + sequence par.    s·b·h·(34 + 5·a·s/h) / t
    selective recompute       drops the 5·a·s/h term (attention scores are recomputed)
    full recompute            2·s·b·h (the layer input only; /t with sequence parallelism)
The 34 counts a GPT layer with a 4h GeLU MLP; the MLP part (19 of the 34: 2sbh input, 8sbh up-projection
output, 8sbh GeLU output, sbh dropout mask) scales with ffn/(4h) and a SwiGLU MLP keeps three ffn-wide
tensors instead of two. Flash attention (Dao et al. 2022) keeps no s×s scores, like selective recompute.
"""

from __future__ import annotations

from dataclasses import replace

from nereus.cost.moe import expert_params_per_rank
from nereus.spec.layout import Layout
from nereus.spec.model import ModelArch
from nereus.spec.parallel_dims import fullest_stage_layers

BF16 = 2
FP32 = 4
# Mixed-precision Adam per parameter (Megatron-LM; Rajbhandari et al. 2020, ZeRO, Sec. 3.1):
# fp32 master weights, first and second moments.
OPTIMIZER_BYTES_PER_PARAM = 3 * FP32


def mlp_activation_coeff(arch: ModelArch) -> float:
    """Bytes per s·b·h the MLP stores: 19 for a 4h GeLU MLP (input 2, up output 2r, GeLU output 2r,
    dropout mask 1; r = ffn/h), Korthikanti et al. 2022, Sec. 4.1. SwiGLU keeps its input, the fused
    gate/up output (4r) and their product (2r)."""
    r = arch.ffn_hidden / arch.hidden
    if arch.mlp == "gelu":
        return 2 + 2 * r + 2 * r + 1
    if arch.moe is None:
        return 2 + 6 * r
    # A sparse layer keeps its input, each of the token's top_k permuted copies (2), their SwiGLU tensors at
    # the expert width and their outputs before the weighted combine (2), and the shared expert's SwiGLU
    # (Megatron-Core MoE keeps the permuted tokens for backward: token_dispatcher, experts' GroupedMLP).
    m, h = arch.moe, arch.hidden
    sparse = 2 + m.top_k * (4 + 6 * m.expert_ffn_hidden / h) + 6 * m.shared_expert_ffn_hidden / h
    share = arch.sparse_layers() / arch.layers
    return share * sparse + (1 - share) * (2 + 6 * r)


def attention_activation_coeff(arch: ModelArch) -> float:
    """Bytes per s·b·h the attention block and both layernorms store besides the s×s scores: 15 for
    multi-head attention (QKV input 2, Q 2, K 2, V 2, projection input 2, dropout mask 1, layernorm
    inputs 4). With grouped-query attention K and V shrink by kv_heads/heads; Q, K, V and the projection
    input scale with heads·head_dim / hidden where head_dim is given (Qwen3), and Qwen3's q/k norms keep
    their inputs (2 per Q and K element)."""
    q = arch.heads * arch.head_dim / arch.hidden
    kv = arch.kv_heads * arch.head_dim / arch.hidden
    norms = 2 * (q + kv) if arch.qk_norm else 0.0
    return 7 + 4 * q + 4 * kv + norms


def layer_activation_bytes(arch: ModelArch, layout: Layout, seq: int, mbs: int, attention: str) -> float:
    """Activations one layer stores for backward, per micro-batch and device (Korthikanti et al. 2022)."""
    s, b, h, t = seq, mbs, arch.hidden, layout.tp
    sbh = s * b * h
    scores = 5 * arch.heads * s / h if attention == "standard" else 0.0
    if layout.recompute == "full":
        return 2 * sbh / (t if layout.sequence_parallel else 1)
    if layout.recompute == "selective":
        scores = 0.0
    per_layer = attention_activation_coeff(arch) + mlp_activation_coeff(arch)  # 34 for GPT
    if layout.sequence_parallel or t == 1:
        return sbh * (per_layer + scores) / t
    # Without sequence parallelism the layernorm/dropout/residual tensors (10 of the 34) are replicated.
    return sbh * (10 + (per_layer - 10) / t + scores / t)


def stage_layers(arch: ModelArch, pp: int) -> int:
    """Layers on the fullest pipeline stage: an uneven split as Megatron-Core lays it out, the remainder on
    the first and last stages (``spec.parallel_dims.fullest_stage_layers``)."""
    return fullest_stage_layers(arch.layers, pp)


def layer_params_per_rank(arch: ModelArch, tp: int, ep: int = 1) -> float:
    """One layer's parameters on one tensor-parallel rank: the split matrices (and biases) over TP, the
    norm weights (two, plus Qwen3's q/k norms) replicated, and K/V replicated beyond the KV-head count
    (nereus.spec.sharding); an MoE layer's routed experts further split over ``ep`` (``cost.moe``)."""
    norms = arch.replicated_layer_params()
    kv = 2 * arch.kv_heads * arch.head_dim * (arch.hidden + (1 if arch.qkv_bias else 0))
    rest = arch.layer_params() - norms - kv
    per_rank = rest / tp + kv / min(tp, arch.kv_heads) + norms
    return per_rank - expert_params_per_rank(arch, tp, ep) if ep > 1 else per_rank


def stage_params(arch: ModelArch, layout: Layout, value_head: bool) -> float:
    """Parameters on the fullest device: its layers' share plus embedding/head on the end stages.

    With PP > 1 the embedding sits on the first stage and the head on the last; with tied embeddings the
    last stage keeps its own copy (Megatron-LM). The final norm and a value head are replicated over TP.
    """
    layers = stage_layers(arch, layout.pp) * layer_params_per_rank(arch, layout.tp, layout.ep)
    emb = arch.embedding_params() / layout.tp
    head = arch.hidden if value_head else arch.vocab * arch.hidden / layout.tp
    ends = emb + head if layout.pp == 1 else max(emb, head)
    if layout.pp == 1 and arch.tied_embeddings and not value_head:
        ends = emb
    return layers + ends + arch.hidden


def trainer_weight_bytes(arch: ModelArch, layout: Layout, weight_bytes: int = BF16) -> float:
    """The weights a training layout's fullest device holds (FSDP's share of them: ``training_state_bytes``)."""
    return training_state_bytes(stage_params(arch, layout, value_head=False), layout, 0, weight_bytes)["weights"]


def training_state_bytes(params: float, layout: Layout, grad_bytes: int, weight_bytes: int = BF16) -> dict[str, float]:
    """Weights (bf16), gradient buffers and Adam state per device; ZeRO-1 shards the optimizer over DP
    (Rajbhandari et al. 2020, Sec. 5.1: P_os); FSDP / ZeRO-3 shards all three (P_os+g+p)."""
    if layout.fsdp:
        return {k: v / layout.dp for k, v in training_state_bytes(params, replace(layout, fsdp=False, zero1=False),
                                                                  grad_bytes, weight_bytes).items()}
    shard = layout.dp if layout.zero1 else 1
    return {
        "weights": params * weight_bytes,
        "gradients": params * grad_bytes,
        "optimizer": params * OPTIMIZER_BYTES_PER_PARAM / shard,
    }


def logits_bytes(arch: ModelArch, tokens: float, tp: int, value_head: bool, with_grad: bool) -> float:
    """fp32 logits of the vocabulary-parallel head (and their gradient in training)."""
    if value_head:
        return tokens * FP32 * (2 if with_grad else 1)
    return tokens * arch.vocab / tp * FP32 * (2 if with_grad else 1)
