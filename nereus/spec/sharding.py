"""Where every weight tensor of a model lives under a layout: the contract between the runtime's shards
and the transition graph's boxes.

Tensor names follow HuggingFace Llama/Qwen2/Qwen3 checkpoints. Tensor parallelism follows Megatron-LM
(Shoeybi et al. 2019): column-parallel q/k/v/gate/up split their output rows, row-parallel o/down split
their input columns, the embedding and LM head split the vocabulary; norms (Qwen3's per-head q/k norms
too) and the value head are replicated. When TP exceeds the KV heads, each KV head is replicated on
tp/kv_heads consecutive ranks.
Each ``TensorSpec`` says, as data written where the tensor list is built, which dimension TP splits
(``tp_dim``) and in units of what (``unit``): whole query heads (q, o), whole KV heads (k, v), or rows
and columns (everything else). The degrees and rank coordinates come from ``spec.parallel_dims``.
Pipeline stages take contiguous layer ranges, the remainder going to the first stages; the embedding
sits on the first stage, the final norm and the head on the last. ``Layout.interleave`` changes the
pipeline schedule only: placement stays contiguous layer ranges, as the runtime builds its stages.
Expert parallelism (``ep``) places each routed expert's tensors (``TensorSpec.expert``) only on the DP
ranks whose EP rank owns it (``expert_range``: a contiguous ``1/ep`` of the experts; ``holds``), so a rank
loads, snapshots and moves only its experts; every other tensor stays on every DP rank.

ZeRO-1 optimizer state (fp32 master weights, Adam m and v) is sharded over data parallelism as the
distributed optimizers of Megatron-LM and DeepSpeed do (Rajbhandari et al. 2020, Sec. 5.1): the tensors
a rank holds, in checkpoint order, are flattened row-major and concatenated, and the flat buffer is split
into dp near-equal contiguous ranges (``split_range``). A range cuts a 2-D tensor into a partial row,
whole rows and a partial row, so a rank's part of a tensor is a set of up to three boxes
(``zero_shards``). With ``Layout.fsdp`` (ZeRO-3) the weights and gradient buffers are sharded the same
way. The runtime's ``ShardedAdam`` concatenates its parameters in this order; the last stage's copy of a
tied embedding (``tied_head``) is not in it: it follows the embedding's updated rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from nereus.spec.model import ModelArch
from nereus.spec.parallel_dims import ParallelDims

Box = tuple[tuple[int, int], ...]  # (start, stop) per dimension, in global coordinates

# what TP splits ``tp_dim`` into: near-equal ranges of its elements, whole query heads, whole KV heads
# (replicated on tp/kv_heads consecutive ranks when TP exceeds them)
ELEMENTS, HEADS, KV_HEADS = "elements", "heads", "kv_heads"
UNITS = (ELEMENTS, HEADS, KV_HEADS)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None  # dimension split by tensor parallelism; None = replicated over TP
    layer: int | None  # decoder layer index; None for embedding, final norm and heads
    position: str = "layer"  # "first" (embedding), "layer", "last" (final norm, heads)
    unit: str = ELEMENTS  # what ``tp_dim`` is split into (``UNITS``)
    expert: int | None = None  # an MoE layer's routed expert (global index) the tensor belongs to

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise ValueError(f"TensorSpec.unit: {self.unit!r}; one of {', '.join(UNITS)}")


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
        out.append(TensorSpec(p + "self_attn.q_proj.weight", (arch.heads * hd, h), 0, i, unit=HEADS))
        out.append(TensorSpec(p + "self_attn.k_proj.weight", (arch.kv_heads * hd, h), 0, i, unit=KV_HEADS))
        out.append(TensorSpec(p + "self_attn.v_proj.weight", (arch.kv_heads * hd, h), 0, i, unit=KV_HEADS))
        if arch.qkv_bias:
            out.append(TensorSpec(p + "self_attn.q_proj.bias", (arch.heads * hd,), 0, i, unit=HEADS))
            out.append(TensorSpec(p + "self_attn.k_proj.bias", (arch.kv_heads * hd,), 0, i, unit=KV_HEADS))
            out.append(TensorSpec(p + "self_attn.v_proj.bias", (arch.kv_heads * hd,), 0, i, unit=KV_HEADS))
        if arch.qk_norm:  # one weight for all heads: replicated, each TP rank normalises its own heads
            out.append(TensorSpec(p + "self_attn.q_norm.weight", (hd,), None, i))
            out.append(TensorSpec(p + "self_attn.k_norm.weight", (hd,), None, i))
        out.append(TensorSpec(p + "self_attn.o_proj.weight", (h, arch.heads * hd), 1, i, unit=HEADS))
        out.append(TensorSpec(p + "post_attention_layernorm.weight", (h,), None, i))
        if arch.moe is not None and arch.moe.sparse(i):
            out += moe_layer_tensors(arch, i)
            continue
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


def _swiglu(prefix: str, width: int, hidden: int, layer: int, expert: int | None = None) -> list[TensorSpec]:
    """gate/up column-parallel, down row-parallel, as the dense MLP."""
    return [TensorSpec(prefix + "gate_proj.weight", (width, hidden), 0, layer, expert=expert),
            TensorSpec(prefix + "up_proj.weight", (width, hidden), 0, layer, expert=expert),
            TensorSpec(prefix + "down_proj.weight", (hidden, width), 1, layer, expert=expert)]


def moe_layer_tensors(arch: ModelArch, layer: int) -> list[TensorSpec]:
    """The MLP tensors of sparse layer ``layer`` (Qwen's names; ``runtime.model.hf`` maps Mixtral's): the
    router (replicated), each routed expert (TP inside the expert, like the dense MLP), and Qwen2-MoE's
    shared expert with its one-output gate (replicated)."""
    moe, h = arch.moe, arch.hidden
    p = f"model.layers.{layer}.mlp."
    out = [TensorSpec(p + "gate.weight", (moe.experts, h), None, layer)]
    for e in range(moe.experts):
        out += _swiglu(f"{p}experts.{e}.", moe.expert_ffn_hidden, h, layer, e)
    if moe.shared_expert_ffn_hidden:
        out += _swiglu(p + "shared_expert.", moe.shared_expert_ffn_hidden, h, layer)
        out.append(TensorSpec(p + "shared_expert_gate.weight", (1, h), None, layer))
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
    if t.unit == KV_HEADS:
        hd = arch.head_dim
        if tp <= arch.kv_heads:
            lo, hi = split_range(arch.kv_heads, tp, tp_rank)
        else:  # tp/kv_heads consecutive ranks share one KV head
            lo = tp_rank * arch.kv_heads // tp
            hi = lo + 1
        full[t.tp_dim] = (lo * hd, hi * hd)
    elif t.unit == HEADS:
        lo, hi = split_range(arch.heads, tp, tp_rank)  # whole heads per rank
        full[t.tp_dim] = (lo * arch.head_dim, hi * arch.head_dim)
    else:
        full[t.tp_dim] = split_range(t.shape[t.tp_dim], tp, tp_rank)
    return tuple(full)


def expert_range(experts: int, ep: int, ep_rank: int) -> range:
    """The routed experts (global indices) EP rank ``ep_rank`` of ``ep`` holds: a contiguous ``1/ep`` of them,
    as Megatron-Core splits its experts."""
    return range(*split_range(experts, ep, ep_rank))


def holds(t: TensorSpec, arch: ModelArch, dims: ParallelDims, dp_rank: int) -> bool:
    """Whether DP rank ``dp_rank`` holds ``t`` at all: every tensor but the routed experts of other EP ranks
    (expert parallelism splits experts over ``ep`` consecutive DP ranks: ``ParallelDims.ep_rank``)."""
    if t.expert is None or dims.ep == 1:
        return True
    return t.expert in expert_range(arch.moe.experts, dims.ep, dims.ep_rank(dp_rank))


def rank_tensors(arch: ModelArch, dims: ParallelDims, rank: int, value_head: bool = False) -> dict[str, Box]:
    """Every tensor box held by ``rank`` of a layout's ``dims`` (its coordinates: ``ParallelDims.coords``)."""
    pp_rank, dp_rank, tp_rank = dims.coords(rank)
    return {
        t.name: tp_box(t, arch, dims.tp, tp_rank)
        for t in model_tensors(arch, value_head)
        if tensor_stage(t, arch, dims.pp) == pp_rank and holds(t, arch, dims, dp_rank)
    }


def box_volume(box: Box) -> int:
    n = 1
    for lo, hi in box:
        if hi <= lo:
            return 0
        n *= hi - lo
    return n


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of one tensor, or None when they do not overlap."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):  # noqa: B905 (same rank by construction; hot path)
        lo = a0 if a0 > b0 else b0
        hi = a1 if a1 < b1 else b1
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def _flat_local(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    if lo >= hi:
        return []
    if len(shape) == 1:
        return [((lo, hi),)]
    inner = 1
    for n in shape[1:]:
        inner *= n
    r0, o0 = divmod(lo, inner)
    r1, o1 = divmod(hi, inner)
    if r0 == r1:  # inside one row
        return [((r0, r0 + 1), *b) for b in _flat_local(shape[1:], o0, o1)]
    out: list[Box] = []
    if o0:  # partial first row
        out += [((r0, r0 + 1), *b) for b in _flat_local(shape[1:], o0, inner)]
        r0 += 1
    if r1 > r0:  # whole rows
        out.append(((r0, r1), *((0, n) for n in shape[1:])))
    if o1:  # partial last row
        out += [((r1, r1 + 1), *b) for b in _flat_local(shape[1:], 0, o1)]
    return out


def flat_range_boxes(box: Box, lo: int, hi: int) -> tuple[Box, ...]:
    """Elements ``lo:hi`` of ``box`` flattened row-major, as disjoint global boxes."""
    shape = tuple(b - a for a, b in box)
    return tuple(tuple((a + x0, a + x1) for (a, _), (x0, x1) in zip(box, local, strict=True))
                 for local in _flat_local(shape, lo, hi))


def rank_order(arch: ModelArch, dims: ParallelDims, stage: int, tp_rank: int,
               value_head: bool = False, dp_rank: int = 0) -> list[tuple[str, Box]]:
    """The tensors pipeline stage ``stage``, TP rank ``tp_rank`` (and DP rank ``dp_rank``: under expert
    parallelism, its experts) holds, in checkpoint order, with boxes."""
    return [(t.name, tp_box(t, arch, dims.tp, tp_rank)) for t in model_tensors(arch, value_head)
            if tensor_stage(t, arch, dims.pp) == stage and holds(t, arch, dims, dp_rank)]


def zero_shards(arch: ModelArch, dims: ParallelDims, stage: int, tp_rank: int, dp_rank: int,
                value_head: bool = False, zero: bool = True) -> dict[str, tuple[Box, ...]]:
    """ZeRO part of DP rank ``dp_rank``: its range of the flat buffer of the rank's tensors (checkpoint
    order, each flattened row-major), as boxes per tensor it touches (tensors outside left out); the whole
    buffer without ``zero``. Under expert parallelism a rank has two buffers, listed in this order: the
    dense tensors' (split over DP) and its routed experts' (split over the ``dp / ep`` DP ranks holding
    the same experts, Megatron-Core's expert-data-parallel group)."""
    order = rank_order(arch, dims, stage, tp_rank, value_head, dp_rank)
    if dims.ep == 1:
        return _flat_part(order, dims.dp if zero else 1, dp_rank if zero else 0)
    experts = {t.name for t in model_tensors(arch, value_head) if t.expert is not None}
    dense = _flat_part([x for x in order if x[0] not in experts], dims.dp if zero else 1, dp_rank if zero else 0)
    return {**dense, **_flat_part([x for x in order if x[0] in experts], dims.dp // dims.ep if zero else 1,
                                  dims.edp_rank(dp_rank) if zero else 0)}


def _flat_part(order: list[tuple[str, Box]], parts: int, index: int) -> dict[str, tuple[Box, ...]]:
    """Part ``index`` of ``parts`` of the flat buffer of ``order``'s boxes, as boxes per tensor it touches."""
    total = sum(box_volume(b) for _, b in order)
    lo, hi = split_range(total, parts, index)
    out, offset = {}, 0
    for name, box in order:
        n = box_volume(box)
        a, b = max(lo, offset), min(hi, offset + n)
        if a < b:
            out[name] = flat_range_boxes(box, a - offset, b - offset)
        offset += n
    return out
