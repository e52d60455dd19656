"""The sparse MLP of a Mixture-of-Experts decoder layer (Qwen3-MoE, Qwen2-MoE, Mixtral) in plain PyTorch.

A linear router scores every expert per token; ``route`` keeps the ``top_k`` best of the softmax (in fp32)
and renormalises them when the checkpoint says so, as transformers' ``Qwen3MoeTopKRouter`` /
``MixtralTopKRouter`` do. Each token's output is the weighted sum of its experts' SwiGLU MLPs; Qwen2-MoE
adds a shared expert every token passes through, scaled by ``sigmoid(shared_expert_gate(x))``.

Parameter names are Qwen's HuggingFace names (``mlp.gate.weight``, ``mlp.experts.{i}.gate_proj.weight``,
``mlp.shared_expert.*``, ``mlp.shared_expert_gate.weight``), so a model's ``state_dict`` keys are the
tensor names of ``nereus.spec.sharding``; Mixtral's on-disk names are mapped in ``model.hf`` only.
``MoEBlock.experts`` is keyed by the global expert index, so a rank that holds some experts keeps their
names. The expert computation is a swappable slot (``MoEBlock.dispatch``): ``LocalDispatch`` computes the
experts present on their routed tokens; expert parallelism swaps in an all-to-all dispatcher
(``runtime.parallel``). The math here knows nothing of parallelism.

Router replay and the load-balancing loss go through one ``RoutingRecord`` passed with a forward call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from nereus.spec.moe import MoESpec


def route(logits: torch.Tensor, top_k: int, normalize: bool,
          replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights [N, k] (in ``logits``' dtype) and expert indices [N, k] (long) from router
    ``logits`` [N, E]: softmax over all experts in fp32, the ``top_k`` largest (or the ``replay`` indices,
    whose weights are read from the current softmax), renormalised to sum to 1 when ``normalize``."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if replay is None:
        top, indices = torch.topk(probs, top_k, dim=-1)
    else:
        indices = replay.to(device=logits.device, dtype=torch.long)
        top = probs.gather(-1, indices)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), indices


class _JoinLoss(torch.autograd.Function):
    """``h`` unchanged; in backward also the gradient ``weight`` into the scalar ``loss``, so a loss formed inside a
    forward trains with whatever loss the output feeds, on any pipeline stage, without being added to it
    (Megatron-Core's ``MoEAuxLossAutoScaler`` does the same)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, loss: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full((), ctx.weight, dtype=torch.float32, device=grad.device), None


class RoutingRecord:
    """The routing of one forward call, layer by layer: recorded, or replayed from an earlier record, plus the
    statistics of the load-balancing loss.

    Recording stores each sparse layer's expert indices [N, k] (``indices``, keyed by global layer index);
    replaying makes every sparse layer route to the given indices instead of its own top-k, the weights
    recomputed from the current router logits at those indices (so gradients still reach the router) --
    slime's and NeMo-RL's router replay, which makes training's log-probs use the experts generation used.
    Layers overwrite their entry, so a layer recomputed under activation checkpointing records the same
    thing again. With ``aux``, each sparse layer also keeps its expert assignment counts and router
    probability sums (``token_mask`` [N] leaves padding out), from which ``aux_loss`` forms the Switch
    Transformer loss (Fedus et al. 2021, eq. 4) as transformers' ``load_balancing_loss_func`` does; training
    joins it, times ``aux_weight``, to the backward of the forward's output (``join_aux_loss``), summed over
    ranks by ``reduce`` where they split the tokens.
    """

    def __init__(self, replay: Mapping[int, torch.Tensor] | None = None, aux: bool = False,
                 token_mask: torch.Tensor | None = None, aux_weight: float = 0.0,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.replay = dict(replay) if replay is not None else None
        self.aux = aux
        self.token_mask = token_mask
        self.aux_weight, self.reduce = aux_weight, reduce
        self.indices: dict[int, torch.Tensor] = {}
        self.stats: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # counts, prob sums, rows

    def replayed(self, layer: int, tokens: int, top_k: int) -> torch.Tensor | None:
        """The indices layer ``layer`` must route ``tokens`` tokens to, or None when not replaying."""
        if self.replay is None:
            return None
        if layer not in self.replay:
            raise KeyError(f"router replay has no indices for layer {layer} (recorded layers: {sorted(self.replay)})")
        got = self.replay[layer]
        if tuple(got.shape) != (tokens, top_k):
            raise ValueError(f"router replay of layer {layer}: indices of shape {tuple(got.shape)}, but the layer "
                             f"routes {tokens} tokens to {top_k} experts each")
        return got

    def observe(self, layer: int, logits: torch.Tensor, indices: torch.Tensor) -> None:
        """What sparse layer ``layer`` routed: ``logits`` [N, E] and the indices [N, k] it used."""
        self.indices[layer] = indices.detach()
        if not self.aux:
            return
        experts = logits.shape[-1]
        probs = torch.softmax(logits.float(), dim=-1)
        if self.token_mask is None:
            counts = torch.bincount(indices.reshape(-1), minlength=experts).float()
            rows = torch.tensor(float(logits.shape[0]), device=logits.device)
            self.stats[layer] = (counts, probs.sum(0), rows)
            return
        keep = self.token_mask.reshape(-1).to(device=logits.device, dtype=torch.float32)
        counts = torch.zeros(experts, device=logits.device).index_add_(
            0, indices.reshape(-1), keep.repeat_interleave(indices.shape[-1]))
        self.stats[layer] = (counts, (probs * keep[:, None]).sum(0), keep.sum())

    def layer_stats(self) -> torch.Tensor:
        """[L, 2E + 1] per sparse layer seen (in layer order): expert assignment counts, router probability sums
        (differentiable) and token rows -- sums, so ranks that split the tokens can add theirs (``reduce``)."""
        if not self.stats:
            raise ValueError("no load-balancing statistics: give RoutingRecord(aux=True) to a forward of an MoE model")
        return torch.stack([torch.cat([c, p, r.reshape(1)]) for _, (c, p, r) in sorted(self.stats.items())])

    def aux_loss(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """E · Σ_e f_e · P_e with f_e the share of top-k assignments and P_e the mean router probability of
        expert e, over every sparse layer's tokens pooled (transformers' ``aux_loss``, before the config's
        ``router_aux_loss_coef``). ``reduce`` sums ``layer_stats`` over ranks that split the tokens (e.g. an
        all-reduce that keeps the gradient), so the loss is the one of the whole token set."""
        return _switch_loss(self._reduced(reduce).sum(0, keepdim=True))[0]

    def layer_aux_losses(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """[L]: the same loss of each sparse layer on its own (Megatron-Core's form, which training uses: a sum
        over layers splits over pipeline stages, transformers' pooled form does not)."""
        return _switch_loss(self._reduced(reduce))

    def _reduced(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
        stats = self.layer_stats()
        return stats if reduce is None else reduce(stats)

    def join_aux_loss(self, h: torch.Tensor) -> torch.Tensor:
        """``h`` (the output of the forward this record saw) with ``aux_weight`` × the sum of ``layer_aux_losses``
        joined to its backward: gradients of whatever loss ``h`` feeds then include the load-balancing loss's.
        ``h`` as it is when the forward routed nothing (a pipeline stage without sparse layers) or the weight
        is 0."""
        if not self.aux_weight or not self.stats:
            return h
        return _JoinLoss.apply(h, self.layer_aux_losses(self.reduce).sum(), self.aux_weight)


def _switch_loss(stats: torch.Tensor) -> torch.Tensor:
    """E · Σ_e (counts_e / rows) · (prob sums_e / rows) of each row of ``stats`` [L, 2E + 1]."""
    experts = (stats.shape[1] - 1) // 2
    rows = stats[:, -1:]
    return experts * torch.sum((stats[:, :experts] / rows) * (stats[:, experts:2 * experts] / rows), dim=1)


class LocalDispatch(nn.Module):
    """Every expert present in ``experts`` applied to the tokens routed to it, outputs weighted and summed per
    token. An expert no token chose still runs on zero rows, so its gradient is zeros rather than missing
    (data-parallel gradient sums and ZeRO buffers expect every parameter's). Holds no tensors."""

    def forward(self, experts: nn.ModuleDict, x: torch.Tensor, weights: torch.Tensor,
                indices: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for key, expert in experts.items():
            token, slot = torch.where(indices == int(key))
            y = expert(x[token]) * weights[token, slot, None]
            out = out.index_add(0, token, y.to(out.dtype))
        return out


class MoEBlock(nn.Module):
    """``model.layers.{i}.mlp`` of a sparse layer: router ``gate``, routed ``experts`` (``make_mlp(width)``
    builds each, the decoder's SwiGLU MLP), and Qwen2-MoE's shared expert with its sigmoid gate."""

    def __init__(self, moe: MoESpec, hidden: int, layer: int, make_mlp: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.layer, self.top_k, self.normalize = layer, moe.top_k, moe.norm_topk_prob
        self.gate = nn.Linear(hidden, moe.experts, bias=False)
        self.experts = nn.ModuleDict({str(e): make_mlp(moe.expert_ffn_hidden) for e in range(moe.experts)})
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if moe.shared_expert_ffn_hidden:
            self.shared_expert = make_mlp(moe.shared_expert_ffn_hidden)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        # the experts' shared input: TP makes it the start of a column-parallel region (``parallel.tp``); the
        # router and the shared gate read the input before it, being replicated
        self.tp_input: nn.Module = nn.Identity()
        self.dispatch: nn.Module = LocalDispatch()  # expert parallelism swaps in an all-to-all

    def mlps(self) -> list[nn.Module]:
        """The SwiGLU MLPs this block holds (its routed experts here, the shared one): what tensor parallelism
        makes column/row parallel, as it does the dense MLP."""
        return [*self.experts.values(), *([self.shared_expert] if self.shared_expert is not None else [])]

    def forward(self, x: torch.Tensor, routing: RoutingRecord | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.gate(flat)
        replay = routing.replayed(self.layer, flat.shape[0], self.top_k) if routing is not None else None
        weights, indices = route(logits, self.top_k, self.normalize, replay)
        if routing is not None:
            routing.observe(self.layer, logits, indices)
        inputs = self.tp_input(flat)
        out = self.dispatch(self.experts, inputs, weights, indices)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(inputs)
        return out.reshape(x.shape)
