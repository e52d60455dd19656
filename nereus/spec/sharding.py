"""Where every weight tensor of a model lives under a layout: the contract between the runtime's shards
and the transition graph's boxes.

Tensor names follow HuggingFace Llama/Qwen2 checkpoints. Tensor parallelism follows Megatron-LM
(Shoeybi et al. 2019): column-parallel q/k/v/gate/up split their output rows, row-parallel o/down split
their input columns, the embedding and LM head split the vocabulary; norms and the value head are
replicated. When TP exceeds the KV heads, each KV head is replicated on tp/kv_heads consecutive ranks.
Pipeline stages take contiguous layer ranges, the remainder going to the first stages; the embedding
sits on the first stage, the final norm and the head on the last.
"""

from __future__ import annotations

from dataclasses import dataclass

from nereus.spec.layout import Layout
from nereus.spec.model import ModelArch

Box = tuple[tuple[int, int], ...]  # (start, stop) per dimension, in global coordinates


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None  # dimension split by tensor parallelism; None = replicated over TP
    layer: int | None  # decoder layer index; None for embedding, final norm and heads
    position: str = "layer"  # "first" (embedding), "layer", "last" (final norm, heads)
    kv: bool = False  # a K/V projection: split by KV heads, replicated when tp > kv_heads


def split_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """The ``index``-th of ``parts`` contiguous pieces of ``range(size)``; earlier pieces get the remainder."""
    base, extra = divmod(size, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def layer_range(layers: int, pp: int, stage: int) -> range:
    return range(*split_range(layers, pp, stage))


def model_tensors(arch: ModelArch, value_head: bool = False) -> list[TensorSpec]:
    """Every weight of the model with its global shape, in checkpoint order."""
    h, hd = arch.hidden, arch.head_dim
    out = [TensorSpec("model.embed_tokens.weight", (arch.vocab, h), 0, None, "first")]
    for i in range(arch.layers):
        p = f"model.layers.{i}."
        out.append(TensorSpec(p + "input_layernorm.weight", (h,), None, i))
        out.append(TensorSpec(p + "self_attn.q_proj.weight", (arch.heads * hd, h), 0, i))
        out.append(TensorSpec(p + "self_attn.k_proj.weight", (arch.kv_heads * hd, h), 0, i, kv=True))
        out.append(TensorSpec(p + "self_attn.v_proj.weight", (arch.kv_heads * hd, h), 0, i, kv=True))
        if arch.qkv_bias:
            out.append(TensorSpec(p + "self_attn.q_proj.bias", (arch.heads * hd,), 0, i))
            out.append(TensorSpec(p + "self_attn.k_proj.bias", (arch.kv_heads * hd,), 0, i, kv=True))
            out.append(TensorSpec(p + "self_attn.v_proj.bias", (arch.kv_heads * hd,), 0, i, kv=True))
        out.append(TensorSpec(p + "self_attn.o_proj.weight", (h, arch.heads * hd), 1, i))
        out.append(TensorSpec(p + "post_attention_layernorm.weight", (h,), None, i))
        if arch.mlp == "swiglu":
            out.append(TensorSpec(p + "mlp.gate_proj.weight", (arch.ffn_hidden, h), 0, i))
        out.append(TensorSpec(p + "mlp.up_proj.weight", (arch.ffn_hidden, h), 0, i))
        out.append(TensorSpec(p + "mlp.down_proj.weight", (h, arch.ffn_hidden), 1, i))
    out.append(TensorSpec("model.norm.weight", (h,), None, None, "last"))
    if value_head:
        out.append(TensorSpec("score.weight", (1, h), None, None, "last"))
    elif not arch.tied_embeddings:
        out.append(TensorSpec("lm_head.weight", (arch.vocab, h), 0, None, "last"))
    return out


def tensor_stage(t: TensorSpec, arch: ModelArch, pp: int) -> int:
    """Pipeline stage holding ``t``. Tied embeddings: the last stage uses the first stage's weight,
    which the runtime keeps in sync as Megatron-LM does; its canonical home is stage 0."""
    if t.position == "first":
        return 0
    if t.position == "last":
        return pp - 1
    for stage in range(pp):
        if t.layer in layer_range(arch.layers, pp, stage):
            return stage
    raise ValueError(f"layer {t.layer} beyond {arch.layers} layers")


def tp_box(t: TensorSpec, arch: ModelArch, tp: int, tp_rank: int) -> Box:
    """The global box of ``t`` held by tensor-parallel rank ``tp_rank`` of ``tp``."""
    full = [(0, n) for n in t.shape]
    if t.tp_dim is None or tp == 1:
        return tuple(full)
    size = t.shape[t.tp_dim]
    if t.kv:
        hd = arch.head_dim
        if tp <= arch.kv_heads:
            lo, hi = split_range(arch.kv_heads, tp, tp_rank)
        else:  # tp/kv_heads consecutive ranks share one KV head
            lo = tp_rank * arch.kv_heads // tp
            hi = lo + 1
        full[t.tp_dim] = (lo * hd, hi * hd)
    elif t.name.endswith(("q_proj.weight", "q_proj.bias", "o_proj.weight")):
        lo, hi = split_range(arch.heads, tp, tp_rank)  # whole heads per rank
        full[t.tp_dim] = (lo * arch.head_dim, hi * arch.head_dim)
    else:
        full[t.tp_dim] = split_range(size, tp, tp_rank)
    return tuple(full)


def rank_tensors(arch: ModelArch, layout: Layout, rank: int, value_head: bool = False) -> dict[str, Box]:
    """Every tensor box held by ``rank`` of ``layout`` (rank order: tp fastest, then dp, then pp)."""
    pp_rank, _, tp_rank = layout.coords(rank)
    return {
        t.name: tp_box(t, arch, layout.tp, tp_rank)
        for t in model_tensors(arch, value_head)
        if tensor_stage(t, arch, layout.pp) == pp_rank
    }
