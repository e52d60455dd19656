"""Expert parallelism (Megatron-Core's meaning): the routed experts of every sparse layer are split over ``ep``
consecutive data-parallel ranks (an EP group), each holding a contiguous ``1/ep`` of them
(``sharding.expert_range``); attention, norms, the router and shared experts stay data parallel.

``apply_ep`` cuts a plain model to one rank's experts and swaps ``AllToAllDispatch`` into each
``MoEBlock.dispatch`` slot. A forward then sends every (token, expert) pair of the rank's tokens to the EP
rank owning the expert, runs the local experts on what arrived, sends the outputs back and combines them
with the routing weights: two ``all_to_all_single`` exchanges of variable size (gloo implements them on CPU,
NCCL on GPUs), each differentiable (its backward is the reverse exchange). Every rank of an EP group must
run the same number of MoE forwards (the same number of micro-batches), as every collective requires:
padded micro-batches split every replica's rows alike, packed ones are evened out (``even_packing``).
Generation, whose replicas decode for different numbers of steps, stays ``ep=1``.

Gradients (``reduce_gradients``): dense parameters are averaged over DP as without EP. An expert's
gradient on a rank already sums what every rank of its EP group routed to it; summing over the
expert-data-parallel group (the ``dp / ep`` ranks holding the same experts) then covers every replica's
tokens, and dividing by ``dp`` gives the average the objective (mean over replicas) asks for.

Adam (``ExpertShardedAdam``): the dense parameters' state is ZeRO-1-sharded over DP as before; the experts'
state over the expert-data-parallel group (Megatron-Core's distributed optimizer keeps expert parameters in
their own buffer, sharded over that group, for the same reason: DP ranks of one EP group hold different
experts, so one flat buffer over DP would mix them). The contract's ``sharding.zero_shards`` says the same.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from nereus.runtime.comm.groups import ParallelGroups
from nereus.runtime.model.decoder import CausalLM
from nereus.runtime.model.moe import MoEBlock
from nereus.runtime.parallel.dp import AdamFacts, ShardedAdam, average_gradients, sum_gradients
from nereus.spec.packing import token_budget_groups
from nereus.spec.sharding import expert_range


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` sent in blocks of ``send`` rows to the ranks of ``group`` in order, ``recv`` rows received
    from each; backward sends the gradient rows back the same way reversed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def _exchange_counts(send: torch.Tensor, group: dist.ProcessGroup) -> list[int]:
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.tolist()


class AllToAllDispatch(nn.Module):
    """``MoEBlock.dispatch`` under expert parallelism: the experts of ``experts`` (this rank's: the
    ``ep_rank``-th contiguous ``1/ep`` of ``num_experts``) serve the routed tokens of every rank of ``group``.
    The result equals ``LocalDispatch`` over all experts: each pair's output is its expert's MLP of its
    token times its weight, summed per token in expert order. Holds no tensors."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int, ep: int) -> None:
        super().__init__()
        self.group, self.num_experts, self.ep = group, num_experts, ep

    def forward(self, experts: nn.ModuleDict, x: torch.Tensor, weights: torch.Tensor,
                indices: torch.Tensor) -> torch.Tensor:
        k = indices.shape[-1]
        flat = indices.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs by expert, so by owning rank (experts are contiguous)
        expert, token = flat[order], order // k
        owner = expert // (self.num_experts // self.ep)
        send = torch.bincount(owner, minlength=self.ep).tolist()
        recv = _exchange_counts(torch.tensor(send, dtype=torch.long, device=x.device), self.group)
        arrived = _AllToAll.apply(x[token], recv, send, self.group)
        arrived_expert = torch.empty(sum(recv), dtype=torch.long, device=x.device)
        dist.all_to_all_single(arrived_expert, expert.contiguous(), recv, send, group=self.group)
        served = arrived.new_zeros(arrived.shape)
        for key, mlp in experts.items():  # every local expert runs, on zero rows if none arrived (zero grads)
            rows = torch.where(arrived_expert == int(key))[0]
            served = served.index_add(0, rows, mlp(arrived[rows]).to(served.dtype))
        back = _AllToAll.apply(served, send, recv, self.group)
        pair_weight = weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        return out.index_add(0, token, (back * pair_weight[:, None]).to(out.dtype))


def moe_blocks(model: CausalLM) -> list[MoEBlock]:
    return [layer.mlp for layer in model.model.layers.values() if isinstance(layer.mlp, MoEBlock)]


def apply_ep(model: CausalLM, group: dist.ProcessGroup | None, ep: int, ep_rank: int) -> CausalLM:
    """Keep only EP rank ``ep_rank``'s experts of every sparse layer and swap in the all-to-all dispatcher."""
    moe = model.cfg.arch.moe
    if ep == 1 or moe is None:
        return model
    mine = {str(e) for e in expert_range(moe.experts, ep, ep_rank)}
    for block in moe_blocks(model):
        for key in [k for k in block.experts if k not in mine]:
            del block.experts[key]
        block.dispatch = AllToAllDispatch(group, moe.experts, ep)
    return model


def even_packing(lengths: list[int], replicas: list[list[int]], mine: int, budget: int) -> list[list[int]]:
    """Replica ``mine``'s packed micro-batches (``spec.packing.token_budget_groups`` of its rows
    ``replicas[mine]``, as indices into them), split until it has as many as the replica with most: every rank
    of an EP group must run as many MoE forwards, each an all-to-all with the others. Halving the micro-batch
    with most rows keeps each within the budget and the step's objective the same (each micro-batch's loss
    counts by its rows). Every rank computes every replica's count from the same lengths: no communication."""
    def groups_of(rows: list[int]) -> list[list[int]]:
        return token_budget_groups([lengths[r] for r in rows], budget)

    target = max(len(groups_of(rows)) for rows in replicas)
    groups = groups_of(replicas[mine])
    while len(groups) < target:
        widest = max(range(len(groups)), key=lambda i: len(groups[i]))
        g = groups[widest]
        if len(g) < 2:
            raise ValueError(f"expert parallelism: a replica packs {len(replicas[mine])} rows, fewer than the "
                             f"{target} micro-batches another replica of its EP group runs; give a larger "
                             "max_token_len (or ep=1)")
        groups[widest:widest + 1] = [g[: len(g) // 2], g[len(g) // 2:]]
    return groups


def is_expert(name: str) -> bool:
    """Whether a parameter (checkpoint name) belongs to a routed expert (``mlp.experts.{i}.``)."""
    return ".mlp.experts." in name


def first_copy(name: str, groups: ParallelGroups) -> bool:
    """Whether this rank's copy of weight ``name`` is the one a checkpoint or snapshot keeps: DP replica 0's,
    and under EP each expert's first holder (its EP rank in the first EP group), which together cover the
    model once."""
    c = groups.coords
    if groups.dims.ep > 1 and is_expert(name):
        return groups.dims.edp_rank(c.dp_rank) == 0
    return c.dp_rank == 0


def split_expert_params(named: list[tuple[str, nn.Parameter]]) -> tuple[list, list]:
    """(dense, expert) parameters of ``named``, each keeping the given order."""
    return [x for x in named if not is_expert(x[0])], [x for x in named if is_expert(x[0])]


@torch.no_grad()
def reduce_gradients(model: CausalLM, groups: ParallelGroups) -> None:
    """The data-parallel gradient reduction of a step: every gradient averaged over DP without EP; with it,
    dense gradients averaged over DP and expert gradients summed over the expert-data-parallel group and
    divided by ``dp`` (see the module docstring)."""
    if groups.dims.ep == 1:
        average_gradients(list(model.parameters()), groups.dp_group)
        return
    dense, experts = split_expert_params(list(model.named_parameters()))
    average_gradients([p for _, p in dense], groups.dp_group)
    params = [p for _, p in experts]
    sum_gradients(params, groups.edp_group)
    for p in params:
        if p.grad is not None:
            p.grad.div_(groups.dims.dp)


def expert_grad_square(named: list[tuple[str, torch.Tensor]], groups: ParallelGroups) -> torch.Tensor:
    """Σ grad² over this rank's expert parameters, summed over its EP group (each expert once per TP
    shard): the experts' part of the global gradient norm."""
    sq = torch.zeros((), dtype=torch.float64, device=groups.device)  # on the device: NCCL reduces no CPU tensor
    for name, p in named:
        if is_expert(name) and p.grad is not None:
            sq += p.grad.double().pow(2).sum()
    if groups.ep_group is not None:
        dist.all_reduce(sq, group=groups.ep_group)
    return sq.cpu()


class ExpertShardedAdam:
    """``ShardedAdam`` over two buffers: the dense parameters' (ZeRO-1 over DP) and the experts'
    (ZeRO-1 over the expert-data-parallel group), with one interface: segments, master tensors and moments
    are the dense buffer's followed by the experts', as ``sharding.zero_shards`` lists them."""

    def __init__(self, params: list[tuple[str, nn.Parameter]], groups: ParallelGroups, zero1: bool,
                 **adam) -> None:
        dense, experts = split_expert_params(params)
        self.parts = (ShardedAdam(dense, groups.dp_group, zero1, **adam),
                      ShardedAdam(experts, groups.edp_group, zero1, **adam))

    @property
    def hyper(self) -> dict:
        return self.parts[0].hyper

    @property
    def master(self) -> list[torch.Tensor]:
        return [m for p in self.parts for m in p.master]

    @property
    def segments(self) -> list[tuple[int, int, int]]:
        dense = self.parts[0]
        return dense.segments + [(i + len(dense.params), a, b) for i, a, b in self.parts[1].segments]

    @property
    def lo(self) -> int:
        return 0

    @property
    def hi(self) -> int:
        """With ``lo``: the number of state elements this rank holds (both buffers' ranges)."""
        return sum(p.hi - p.lo for p in self.parts)

    def install_state(self, master: list[torch.Tensor], exp_avg: list[torch.Tensor] | None,
                      exp_avg_sq: list[torch.Tensor] | None, step: float | None) -> None:
        n = len(self.parts[0].segments)
        for part, cut in zip(self.parts, (slice(0, n), slice(n, None)), strict=True):
            part.install_state(master[cut], None if exp_avg is None else exp_avg[cut],
                               None if exp_avg_sq is None else exp_avg_sq[cut], step)

    def ensure_state(self) -> None:
        for p in self.parts:
            p.ensure_state()

    def set_lr(self, lr: float, weight_decay: float | None = None) -> None:
        for p in self.parts:
            p.set_lr(lr, weight_decay)

    def moments(self) -> tuple[list[torch.Tensor], list[torch.Tensor], float] | None:
        got = [p.moments() for p in self.parts]
        known = [m for m in got if m is not None]
        if not known:
            return None
        step = known[0][2]
        return ([t for m in known for t in m[0]], [t for m in known for t in m[1]], step)

    def facts(self) -> AdamFacts:
        dense, experts = (p.facts() for p in self.parts)
        return dense if dense.step or not experts.step else experts

    def step(self) -> None:
        for p in self.parts:
            p.step()

    def flat_master(self) -> torch.Tensor:
        return torch.cat([p.flat_master() for p in self.parts])

    def zero_grad(self) -> None:
        for p in self.parts:
            p.zero_grad()

    def state_bytes(self) -> int:
        return sum(p.state_bytes() for p in self.parts)
