"""ZeRO-3 / FSDP (``Layout.fsdp``): each data-parallel rank keeps only its 1/dp range of its stage's weights,
gradients and Adam state (Rajbhandari et al. 2020, P_os+g+p; PyTorch FSDP, Zhao et al. 2023), gathering a
unit's whole weights over DP just before the unit runs and dropping them after.

The range is the sharding contract's (``spec.sharding.zero_shards``): the rank's local (TP/PP) tensors in
checkpoint order, flattened and concatenated, cut by ``split_range`` — the range ``dp.ShardedAdam`` keeps of
the optimizer state, so a rank's weights, gradients and optimizer state cover the same elements, as the
transition graph's EMUs say (``elastic.emu.placement_states``).

Units: each decoder layer is one, gathered around its call through the layer's ``CallSlot`` (inside a
``Recompute`` slot, so full recomputation gathers again when it re-runs the layer in backward); the
embedding, final norm and head form one more, gathered around the stage's whole forward pass (a tied LM head
uses the embedding at both ends), as FSDP's root unit. A unit's elements in flat order are every rank's
piece of it in DP order, so its gather is an all-gather of the pieces and its gradient reduction a
reduce-scatter of the same pieces.

Autograd: ``_Gather`` makes the unit's gathered weights one flat tensor; the modules' parameter slots hold
views of it during the call and nothing outside. Its backward receives the unit's whole gradient of one
micro-batch, sums the TP shares of TP-replicated tensors (``tp.reduce_tp_replicated``), reduce-scatters over
DP and adds the rank's piece, averaged over DP, into the rank's fp32 gradient range. Weights saved for
backward are not kept: the activation meter hands them to ``Zero3.pack`` (a reference), and backward gathers
the unit again on first use (``unpack``) and drops it after the last. The decoder knows none of this.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nereus.runtime.comm.groups import ParallelGroups
from nereus.runtime.model.decoder import CausalLM
from nereus.runtime.parallel.dp import ShardedAdam
from nereus.runtime.parallel.tp import reduce_tp_replicated
from nereus.spec.sharding import split_range


@dataclass(frozen=True)
class _Slot:
    """One local tensor: the module and attribute holding it, its checkpoint name, shape and flat offset."""

    module: nn.Module
    attr: str
    name: str
    shape: torch.Size
    start: int

    @property
    def numel(self) -> int:
        return self.shape.numel()


@dataclass(eq=False)
class _Gathered:
    """One gather of a unit during a forward pass: how many saved tensors refer to it, and (in backward)
    the unit gathered again for them."""

    unit: _Unit
    refs: int = 0
    again: torch.Tensor | None = None


@dataclass(frozen=True)
class _WeightRef:
    """A saved weight as ``Zero3.pack`` keeps it: which gather, and the view of its flat tensor."""

    gathered: _Gathered
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class _Gather(torch.autograd.Function):
    """The unit's whole weights (forward: all-gather over DP); backward: the rank's averaged gradient piece."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, unit: _Unit) -> torch.Tensor:
        ctx.unit = unit
        return unit.gather()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None]:
        ctx.unit.reduce(grad)
        return None, None


@dataclass(eq=False)
class _Unit:
    owner: Zero3
    slots: list[_Slot]
    pieces: list[list[tuple[int, int]]] = field(init=False)  # per DP rank: its flat ranges of the unit
    sizes: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.slots.sort(key=lambda s: s.start)
        self.pieces = [[(max(s.start, lo), min(s.start + s.numel, hi)) for s in self.slots
                        if max(s.start, lo) < min(s.start + s.numel, hi)] for lo, hi in self.owner.bounds]
        self.sizes = [sum(b - a for a, b in p) for p in self.pieces]

    def _mine(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        lo = self.owner.lo
        return [buffer[a - lo: b - lo] for a, b in self.pieces[self.owner.index]]

    @torch.no_grad()
    def gather(self) -> torch.Tensor:
        o = self.owner
        mine = torch.cat(self._mine(o.weights)) if self.sizes[o.index] else o.weights.new_zeros(0)
        if o.dp == 1:
            return mine.clone()
        widest = max(self.sizes)
        parts = [torch.empty(widest, dtype=mine.dtype, device=mine.device) for _ in self.sizes]
        dist.all_gather(parts, F.pad(mine, (0, widest - mine.numel())), group=o.group)
        return torch.cat([p[:n] for p, n in zip(parts, self.sizes, strict=True)])

    @torch.no_grad()
    def reduce(self, grad: torch.Tensor) -> None:
        o = self.owner
        grad = grad.float().contiguous().clone()
        views, offset = {}, 0
        for s in self.slots:
            views[s.name] = grad[offset: offset + s.numel].view(s.shape)
            offset += s.numel
        o.tp_fixup(views)
        if o.dp > 1:
            widest = max(self.sizes)
            padded = torch.cat([F.pad(c, (0, widest - c.numel())) for c in grad.split(self.sizes)])
            out = torch.empty(widest, dtype=grad.dtype, device=grad.device)
            dist.reduce_scatter_tensor(out, padded, group=o.group)
            grad = out[: self.sizes[o.index]] / o.dp
        offset = 0
        for target in self._mine(o.grads):
            target += grad[offset: offset + target.numel()]
            offset += target.numel()

    def enter(self) -> None:
        """Gather the unit and put views of it into the modules' parameter slots."""
        o = self.owner
        full = _Gather.apply(o.anchor, self) if torch.is_grad_enabled() else self.gather()
        o.live[full.untyped_storage().data_ptr()] = _Gathered(self)
        self._place(full)

    def _place(self, full: torch.Tensor | None) -> None:
        offset = 0
        for s in self.slots:
            s.module._parameters[s.attr] = None if full is None else full[offset: offset + s.numel].view(s.shape)
            offset += s.numel

    def leave(self) -> None:
        """Empty the parameter slots; the gathered weights die with the last reference."""
        for s in self.slots[:1]:
            held = s.module._parameters[s.attr]
            if held is not None:
                self.owner.live.pop(held.untyped_storage().data_ptr(), None)
        self._place(None)

    def around(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run(*args: object) -> torch.Tensor:
            self.enter()
            try:
                return fn(*args)
            finally:
                self.leave()
        return run


class GatherCall(nn.Module):
    """A layer's ``CallSlot`` under ZeRO-3: the layer's unit gathered around the call of the slot it wraps
    (a plain ``CallSlot`` or ``recompute.Recompute``)."""

    def __init__(self, unit: _Unit, inner: nn.Module) -> None:
        super().__init__()
        self.unit, self.inner = unit, inner

    def forward(self, fn: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
        return self.inner(self.unit.around(fn), *args)


class Zero3:
    """The ZeRO-3 state of one rank's shard ``model`` (already cut by ``parallelize`` and loaded): its range
    of the flat weights (in the model's dtype) and of the gradients (fp32), and the units that gather them.
    ``order``: the local tensors' names in the contract's flat order (``sharding.rank_order``). ``weights``:
    the range itself (a transition's new buffer, adopted as it is); else cut from the loaded parameters."""

    def __init__(self, model: CausalLM, order: list[str], groups: ParallelGroups,
                 weights: torch.Tensor | None = None) -> None:
        if groups.layout.ep > 1:
            raise ValueError(f"fsdp with ep={groups.layout.ep}: ZeRO-3 shards over DP only; set fsdp=false or ep=1")
        # a last stage's copy of a tied embedding stays whole: it follows the first stage's (``sum_tied_gradient``)
        params = {n: p for n, p in model.named_parameters() if n != "tied_head"}
        if sorted(params) != sorted(order):
            raise ValueError(f"the shard holds {sorted(params)}, the contract's order {sorted(order)}")
        self.group = groups.dp_group
        self.dp = 1 if self.group is None else dist.get_world_size(self.group)
        self.index = 0 if self.dp == 1 else dist.get_rank(self.group)
        self.numel = sum(params[n].numel() for n in order)
        self.bounds = [split_range(self.numel, self.dp, i) for i in range(self.dp)]
        self.lo, self.hi = self.bounds[self.index]
        if weights is None:
            with torch.no_grad():
                weights = torch.cat([params[n].detach().reshape(-1) for n in order])[self.lo: self.hi].clone()
        if weights.numel() != self.hi - self.lo:
            raise ValueError(f"a ZeRO-3 range of {weights.numel()} elements; this rank's is {self.hi - self.lo}")
        self.weights = weights
        self.grads = torch.zeros(self.hi - self.lo, dtype=torch.float32, device=weights.device)
        self.anchor = torch.zeros((), device=weights.device, requires_grad=True)  # gives every gather a backward to run
        self.live: dict[int, _Gathered] = {}  # storage → the gather it belongs to, while its unit runs
        self.tp_fixup = lambda grads: reduce_tp_replicated(model.cfg, grads, groups.tp_group, groups.dims.tp,
                                                            groups.coords.tp_rank)
        self.slots = self._slots(model, params, order)
        self.units = self._units(model)
        for s in self.slots:
            s.module._parameters[s.attr] = None

    @staticmethod
    def _slots(model: CausalLM, params: dict[str, nn.Parameter], order: list[str]) -> list[_Slot]:
        out, start = [], 0
        for name in order:
            path, _, attr = name.rpartition(".")
            out.append(_Slot(model.get_submodule(path), attr, name, params[name].shape, start))
            start += params[name].numel()
        return out

    def _units(self, model: CausalLM) -> list[_Unit]:
        """One unit per decoder layer (gathered by its ``layer_call``), one for the rest (around ``model``)."""
        units = []
        taken: set[str] = set()
        for index, layer in model.model.layers.items():
            mine = [s for s in self.slots if s.name.startswith(f"model.layers.{index}.")]
            taken.update(s.name for s in mine)
            units.append(_Unit(self, mine))
            layer.layer_call = GatherCall(units[-1], layer.layer_call)
        rest = [s for s in self.slots if s.name not in taken]
        if rest:
            ends = _Unit(self, rest)
            units.append(ends)
            model.register_forward_pre_hook(lambda module, args: ends.enter())
            model.register_forward_hook(lambda module, args, out: ends.leave())
        return units

    def pack(self, t: torch.Tensor) -> _WeightRef | None:
        """A reference for a saved tensor that is a gathered weight (None for anything else)."""
        gathered = self.live.get(t.untyped_storage().data_ptr()) if self.live else None
        if gathered is None:
            return None
        gathered.refs += 1
        return _WeightRef(gathered, tuple(t.shape), tuple(t.stride()), t.storage_offset())

    @staticmethod
    def unpack(ref: _WeightRef) -> torch.Tensor:
        """The saved weight again: its unit gathered once more for the first of its references in backward."""
        g = ref.gathered
        if g.again is None:
            g.again = g.unit.gather()
        out = g.again.as_strided(ref.size, ref.stride, ref.offset)
        g.refs -= 1
        if g.refs == 0:
            g.again = None
        return out

    def segments(self) -> list[tuple[str, int, int]]:
        """(tensor, start, stop) in that tensor's flat order, for this rank's range (``ShardedAdam.segments``)."""
        out = []
        for s in self.slots:
            a, b = max(self.lo, s.start), min(self.hi, s.start + s.numel)
            if a < b:
                out.append((s.name, a - s.start, b - s.start))
        return out

    @torch.no_grad()
    def tensor(self, name: str) -> torch.Tensor:
        """One local tensor whole, gathered over DP (its unit's gather: a collective every DP rank calls)."""
        unit = next(u for u in self.units if any(s.name == name for s in u.slots))
        full, offset = unit.gather(), 0
        for s in unit.slots:
            if s.name == name:
                return full[offset: offset + s.numel].view(s.shape)
            offset += s.numel
        raise KeyError(name)

    @torch.no_grad()
    def sum_tied_gradient(self, tied: nn.Parameter | None, groups: ParallelGroups) -> None:
        """A pipeline with a tied embedding: the last stage sends the DP-averaged gradient of its ``tied_head``
        copy over ``embed_group`` and each first-stage rank adds it to its range of the embedding (one
        optimizer state, the embedding's; ``ShardedModel.sync_tied_head`` copies the result back)."""
        group = groups.embed_group
        if group is None or not (groups.first_stage or tied is not None):
            return
        src = groups.pp_peer(groups.layout.pp - 1)
        if tied is not None:
            grad = tied.grad if tied.grad is not None else torch.zeros_like(tied)
            dist.broadcast(grad.contiguous(), src=src, group=group)
            return
        slot = next(s for s in self.slots if s.name == "model.embed_tokens.weight")
        whole = torch.empty(slot.shape, dtype=self.weights.dtype, device=self.weights.device)
        dist.broadcast(whole, src=src, group=group)
        a, b = max(self.lo, slot.start), min(self.hi, slot.start + slot.numel)
        if a < b:
            self.grads[a - self.lo: b - self.lo] += whole.view(-1)[a - slot.start: b - slot.start].float()

    @torch.no_grad()
    def full_weights(self) -> dict[str, torch.Tensor]:
        """The rank's whole local tensors by name, gathered over DP: a collective every DP rank calls."""
        out = {}
        for unit in self.units:
            full, offset = unit.gather(), 0
            for s in unit.slots:
                out[s.name] = full[offset: offset + s.numel].view(s.shape)
                offset += s.numel
        return {s.name: out[s.name] for s in self.slots}

    @torch.no_grad()
    def clip_gradients(self, max_norm: float, multiplicity: dict[str, int],
                       groups: tuple[dist.ProcessGroup | None, ...]) -> float:
        """``ShardedModel.clip_gradients`` on the gradient range: each element once (a tensor held by
        ``multiplicity[name]`` TP ranks counts once), the squares summed over DP and ``groups`` (TP, PP)."""
        sq, offset = torch.zeros((), dtype=torch.float64, device=self.grads.device), 0
        for name, a, b in self.segments():
            sq += self.grads[offset: offset + b - a].double().pow(2).sum() / multiplicity[name]
            offset += b - a
        for group in (self.group, *groups):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(sq, group=group)
        norm = float(sq.sqrt())
        scale = max_norm / (norm + 1e-6)
        if scale < 1.0:
            self.grads.mul_(scale)
        return norm

    def meta_params(self) -> list[tuple[str, torch.Tensor]]:
        """(name, a shapes-only tensor) in flat order: what ``ShardedAdam`` needs to cut its segments."""
        return [(s.name, torch.empty(s.shape, device="meta")) for s in self.slots]


class Zero3Adam(ShardedAdam):
    """``ShardedAdam`` over a ``Zero3`` range: the gradients come from its gradient range and the updated fp32
    master is cast into its weight range; nothing is gathered (the units gather when they next run)."""

    def __init__(self, zero3: Zero3, lr: float = 1e-3, init_master: bool = True, **adam) -> None:
        super().__init__(zero3.meta_params(), zero3.group, zero1=True, lr=lr, init_master=False, **adam)
        if (self.lo, self.hi) != (zero3.lo, zero3.hi):
            raise RuntimeError(f"Adam's range {(self.lo, self.hi)} is not the ZeRO-3 range {(zero3.lo, zero3.hi)}")
        self.zero3 = zero3
        if init_master:
            sizes = [b - a for _, a, b in self.segments]
            self._install([x.clone() for x in zero3.weights.detach().float().split(sizes)])

    def step(self) -> None:
        if self.opt is None:
            return
        offset = 0
        for m in self.master:
            m.grad = self.zero3.grads[offset: offset + m.numel()]
            offset += m.numel()
        self.opt.step()
        for m in self.master:
            m.grad = None
        with torch.no_grad():
            self.zero3.weights.copy_(self.flat_master())

    def zero_grad(self) -> None:
        self.zero3.grads.zero_()
