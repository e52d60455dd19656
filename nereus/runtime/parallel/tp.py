"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) applied to a plain ``CausalLM`` from outside.

q/k/v/gate/up become column-parallel (their output rows split), o/down row-parallel (their input columns
split, outputs all-reduced), the embedding and LM head vocabulary-parallel; Qwen3's per-head q/k norms
are replicated, their gradients summed over TP after backward (``reduce_tp_replicated``). Every
communication is a module the plain model leaves as a no-op slot and ``apply_tp`` swaps in (no hooks):
``CopyToTP`` at the shared input of a column-parallel region (the attention and MLP inputs, the LM head's
input: identity forward, gradient all-reduce backward, once per region), ``RowParallelLinear`` for o/down
(all-reduce forward), ``VocabParallelEmbedding`` for the embedding. Every slice is the box that
``nereus.spec.sharding.tp_box`` assigns, so shards match the transition graph's EMUs exactly, including
uneven splits (remainder to the first ranks) that DTensor's chunked ``Shard`` placement cannot express.
Attention reshapes by the local head counts. Log-probabilities come from the vocabulary shards without
gathering the logits (a parallel log-softmax: max and sum-exp all-reduced over TP).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nereus.runtime.model.decoder import CausalLM, ModelConfig
from nereus.runtime.model.moe import MoEBlock
from nereus.spec.model import ModelArch
from nereus.spec.parallel_dims import check_split
from nereus.spec.sharding import KV_HEADS, model_tensors, tp_box


def _active(group: dist.ProcessGroup | None) -> bool:
    return group is not None and dist.get_world_size(group) > 1


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the input gradient backward (the input feeds every TP rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward; identity backward (the sum feeds a computation replicated on every TP rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return _CopyToTP.apply(x, group) if _active(group) else x


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group) if _active(group) else x


class CopyToTP(nn.Module):
    """The input of a column-parallel region: every TP rank reads the whole activation, so its gradient is
    the sum of the ranks' partial gradients."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return copy_to_tp(x, self.group)


class RowParallelLinear(nn.Module):
    """A linear layer holding a column slice of the weight; partial outputs are summed over TP."""

    def __init__(self, weight: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(F.linear(x, self.weight), self.group)


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, stop)`` of the embedding; tokens outside give zeros and the TP sum fills them in."""

    def __init__(self, weight: torch.Tensor, start: int, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.start, self.stop, self.group = start, start + weight.shape[0], group

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        outside = (tokens < self.start) | (tokens >= self.stop)
        local = (tokens - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)
        return reduce_from_tp(out, self.group)


def _slice(t: torch.Tensor, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
    return t.detach()[tuple(slice(lo, hi) for lo, hi in box)].clone()


def apply_tp(model: CausalLM, group: dist.ProcessGroup | None, tp: int, tp_rank: int) -> CausalLM:
    """Shard ``model`` (whole-tensor weights) in place into TP rank ``tp_rank`` of ``tp``."""
    arch = model.cfg.arch
    if tp == 1:
        return model
    check_split(arch, tp, "apply_tp")  # whole heads and the KV heads they read on every rank
    specs = {t.name: t for t in model_tensors(arch, model.cfg.value_head)}
    params = dict(model.named_parameters())
    for name, spec in specs.items():
        if name in params and spec.tp_dim is not None:
            params[name].data = _slice(params[name], tp_box(spec, arch, tp, tp_rank))
    for layer in model.model.layers.values():
        attn, mlp = layer.self_attn, layer.mlp
        attn.heads = attn.q_proj.weight.shape[0] // arch.head_dim
        attn.kv_heads = attn.k_proj.weight.shape[0] // arch.head_dim
        attn.o_proj = RowParallelLinear(attn.o_proj.weight.data, group)
        for ffn in mlp.mlps() if isinstance(mlp, MoEBlock) else [mlp]:  # MoE: each expert as an MLP, router replicated
            ffn.down_proj = RowParallelLinear(ffn.down_proj.weight.data, group)
        attn.tp_input, mlp.tp_input = CopyToTP(group), CopyToTP(group)
    embed_box = tp_box(specs["model.embed_tokens.weight"], arch, tp, tp_rank)
    if model.tied_head is not None:  # the last stage's copy of a tied embedding: same vocabulary rows
        model.tied_head.data = _slice(model.tied_head, embed_box)
    if model.model.embed_tokens is not None:
        start = embed_box[0][0]
        model.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens.weight.data, start, group)
    if model.last and not model.cfg.value_head:
        model.head_input = CopyToTP(group)
    return model


def vocab_range(arch: ModelArch, tp: int, tp_rank: int) -> tuple[int, int]:
    """Vocabulary rows ``[start, stop)`` of the embedding / LM head on TP rank ``tp_rank``."""
    return tp_box(model_tensors(arch)[0], arch, tp, tp_rank)[0]


def parallel_logprobs(logits: torch.Tensor, tokens: torch.Tensor, start: int,
                      group: dist.ProcessGroup | None) -> torch.Tensor:
    """log p(tokens) from a vocabulary shard ``logits`` [..., V_local] holding columns ``[start, ...)``."""
    logits = logits.float()
    peak = logits.detach().max(dim=-1).values
    if _active(group):
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - peak[..., None]
    sum_exp = reduce_from_tp(shifted.exp().sum(dim=-1), group)
    local = tokens - start
    inside = (local >= 0) & (local < logits.shape[-1])
    picked = shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1)[..., None]).squeeze(-1)
    picked = reduce_from_tp(picked * inside, group)
    return picked - sum_exp.log()


def _shifted_by_global_max(logits: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """z − max over the whole vocabulary (every TP rank's shard) of ``logits`` [..., V_local] in fp32, so the
    exponentials cannot overflow; the max only shifts, so it is detached."""
    z = logits.float()
    peak = z.detach().max(dim=-1).values
    if _active(group):
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    return z - peak[..., None]


def parallel_entropy(logits: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Entropy H = log Σ e^z − Σ softmax(z)·z of the full-vocabulary distribution (verl's
    ``entropy_from_logits``) from vocabulary shards ``logits`` [..., V_local], without gathering them:
    with s = z − max, H = log S − W / S for S = Σ e^s and W = Σ e^s·s, each summed over the TP ranks
    (differentiable: the sums go through ``reduce_from_tp``; the max only shifts, so it is detached)."""
    shifted = _shifted_by_global_max(logits, group)
    e = shifted.exp()
    total = reduce_from_tp(torch.stack([e.sum(-1), (e * shifted).sum(-1)]), group)
    return total[0].log() - total[1] / total[0]


def parallel_entropy_and_sum_pi_squared(logits: torch.Tensor,
                                        group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``parallel_entropy`` and Σ_v π(v)² of each full-vocabulary distribution (the optimal token baseline's
    input; verl's ``calculate_sum_pi_squared``, exp(logsumexp(2z) − 2·logsumexp(z))) from one pass over the
    vocabulary shards ``logits`` [..., V_local]: with s = z − max, S = Σ e^s, W = Σ e^s·s and Q = Σ e^{2s},
    each summed over the TP ranks, H = log S − W / S and Σπ² = Q / S². For inference (no gradient)."""
    shifted = _shifted_by_global_max(logits, group)
    e = shifted.exp()
    total = torch.stack([e.sum(-1), (e * shifted).sum(-1), (e * e).sum(-1)])
    if _active(group):
        dist.all_reduce(total, group=group)
    return total[0].log() - total[1] / total[0], total[2] / total[0] ** 2


def gather_vocab(logits: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Full-vocabulary logits from the shards of every TP rank (uneven shards padded for all_gather)."""
    if not _active(group):
        return logits
    n = dist.get_world_size(group)
    size = torch.tensor([logits.shape[-1]], device=logits.device)
    sizes = [torch.zeros_like(size) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    widest = int(max(s.item() for s in sizes))
    padded = F.pad(logits.detach().contiguous(), (0, widest - logits.shape[-1]))
    parts = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[..., : int(s.item())] for p, s in zip(parts, sizes, strict=True)], dim=-1)


def reduce_tp_replicated(cfg: ModelConfig, grads: dict[str, torch.Tensor], group: dist.ProcessGroup | None,
                         tp: int, tp_rank: int) -> None:
    """Sum over TP, in place, the gradient shares of the tensors in ``grads`` (name → this rank's local
    gradient) that TP ranks hold in common, each rank having computed only its heads' share:

    - K/V heads replicated when TP exceeds the KV heads (tp/kv_heads ranks hold one head): the shares
      summed over TP, each rank's placed at its head's rows;
    - Qwen3's q/k norm weights (one weight for all heads): one flat all-reduce (Megatron-Core's
      ``finalize_model_grads`` all-reduces its q/k layernorm gradients over TP for the same reason).

    Every rank of ``group`` calls it with the same names (its own boxes)."""
    if not _active(group):
        return
    arch = cfg.arch
    if tp > arch.kv_heads:
        specs = {t.name: t for t in model_tensors(arch, cfg.value_head) if t.unit == KV_HEADS}
        for name in [n for n in grads if n in specs]:
            box = tp_box(specs[name], arch, tp, tp_rank)
            full = torch.zeros(specs[name].shape, dtype=grads[name].dtype, device=grads[name].device)
            index = tuple(slice(lo, hi) for lo, hi in box)
            full[index] = grads[name]
            dist.all_reduce(full, group=group)
            grads[name].copy_(full[index])
    norms = [g for n, g in grads.items() if n.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight"))]
    if arch.qk_norm and norms:
        flat = torch.cat([g.reshape(-1) for g in norms])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in norms:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()
