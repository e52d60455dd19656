"""Data parallelism: gradient averaging over the DP group and Adam with ZeRO-1 sharded state.

``ShardedAdam`` keeps fp32 master weights and Adam's two moments (12 bytes per parameter, the cost
model's ``OPTIMIZER_BYTES_PER_PARAM``) for this rank's contiguous range of its flattened local parameters
(checkpoint order): all of them without ZeRO-1, a ``split_range`` 1/dp share with it (Rajbhandari et al.
2020, P_os). After
the step the updated shares are all-gathered over DP and copied into the model's parameters. Adam is
elementwise, so the sharded update equals the unsharded one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nereus.spec.sharding import split_range


@dataclass(frozen=True)
class AdamFacts:
    """A model's Adam settings and step count: what a rank needs besides the moments to continue the
    optimizer under another layout (live transitions, recovery from snapshots)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    step: float = 0.0

    def settings(self) -> dict[str, float | tuple[float, float]]:
        """The keyword arguments of ``ShardedAdam`` (and ``ShardedModel.make_optimizer``)."""
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay}


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def flat_grads(params: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                      for p in params])


def average_gradients(params: list[torch.nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Average every parameter's gradient over ``group`` (one flat all-reduce)."""
    n = _size(group)
    if n == 1 or not params:
        return
    flat = flat_grads(params)
    dist.all_reduce(flat, group=group)
    flat /= n
    _scatter_into(flat, params, grads=True)


def sum_gradients(params: list[torch.nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Sum gradients over ``group`` (tied embedding copies on the first and last pipeline stage)."""
    if _size(group) == 1 or not params:
        return
    flat = flat_grads(params)
    dist.all_reduce(flat, group=group)
    _scatter_into(flat, params, grads=True)


def _scatter_into(flat: torch.Tensor, params: list[torch.nn.Parameter], grads: bool) -> None:
    offset = 0
    with torch.no_grad():
        for p in params:
            piece = flat[offset: offset + p.numel()].view_as(p).to(p.dtype)
            if grads:
                p.grad = piece.clone()
            else:
                p.copy_(piece)
            offset += p.numel()


class ShardedAdam:
    """Adam with decoupled weight decay (``torch.optim.AdamW`` on fp32 master segments, Loshchilov & Hutter
    2019, the optimizer verl builds; with ``weight_decay`` 0 it is exactly Adam) over ``params``, state
    sharded over ``group`` when ``zero1``. Every rank of ``group`` must call ``step`` together.

    ``params`` are (checkpoint name, parameter) in ``sharding.rank_order``: their concatenation is the ZeRO
    flat buffer of the contract (``sharding.zero_shards``), so the optimizer state this rank holds is
    exactly what the transition graph's EMUs say it holds. The rank's range of that buffer is kept as one
    master *segment* per parameter it touches (a contiguous range of that parameter's flattened local
    shard): a transition then moves, keeps or frees each tensor's optimizer state on its own, as the graph
    plans it per tensor. Adam is elementwise, so segments update exactly as one flat buffer would.
    """

    def __init__(self, params: list[tuple[str, torch.nn.Parameter]], group: dist.ProcessGroup | None,
                 zero1: bool, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, init_master: bool = True) -> None:
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.group = group if zero1 else None
        self.numel = sum(p.numel() for p in self.params)
        n = _size(self.group)
        index = dist.get_rank(self.group) if n > 1 else 0
        self.bounds = [split_range(self.numel, n, i) for i in range(n)]
        self.lo, self.hi = self.bounds[index]
        self.hyper = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        self.segments = self._segments()
        master = []
        if init_master:
            with torch.no_grad():
                master = [self.params[i].detach().reshape(-1)[a:b].float().clone() for i, a, b in self.segments]
        self._install(master)

    def _segments(self) -> list[tuple[int, int, int]]:
        """(parameter index, start, stop) in that parameter's flat order, for this rank's range."""
        out, offset = [], 0
        for i, p in enumerate(self.params):
            a, b = max(self.lo, offset), min(self.hi, offset + p.numel())
            if a < b:
                out.append((i, a - offset, b - offset))
            offset += p.numel()
        return out

    def _install(self, master: list[torch.Tensor]) -> None:
        self.master = master
        # torch's Adam refuses an empty parameter list: a rank whose ZeRO range is empty has no optimizer
        self.opt = torch.optim.AdamW(master, foreach=False, **self.hyper) if master else None

    def install_state(self, master: list[torch.Tensor], exp_avg: list[torch.Tensor] | None,
                      exp_avg_sq: list[torch.Tensor] | None, step: float | None) -> None:
        """Adopt given segments (one fp32 tensor per ``segments`` entry, used as they are, not copied) and,
        after a first step, Adam's moments and step count."""
        if [m.numel() for m in master] != [b - a for _, a, b in self.segments]:
            raise ValueError("optimizer segments do not match this layout's ZeRO range")
        self._install(master)
        if step is not None and self.opt is not None:
            for m, avg, sq in zip(master, exp_avg, exp_avg_sq, strict=True):
                self.opt.state[m] = {"step": torch.tensor(float(step)), "exp_avg": avg, "exp_avg_sq": sq}

    def ensure_state(self) -> None:
        """Adam's state as its first step would create it (zero moments, step 0), so a transition before
        any step moves the same state a later one would; the next step gives the same result."""
        if self.opt is not None and not self.opt.state:
            for m in self.master:
                self.opt.state[m] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(m),
                                     "exp_avg_sq": torch.zeros_like(m)}

    def set_lr(self, lr: float, weight_decay: float | None = None) -> None:
        """The learning rate (and, when given, the decoupled weight decay) of the next steps."""
        changes = {"lr": lr} if weight_decay is None else {"lr": lr, "weight_decay": weight_decay}
        self.hyper.update(changes)
        if self.opt is not None:
            for group in self.opt.param_groups:
                group.update(changes)

    def moments(self) -> tuple[list[torch.Tensor], list[torch.Tensor], float] | None:
        """(exp_avg, exp_avg_sq per segment, step count), or None before the first step."""
        if self.opt is None or not self.opt.state:
            return None
        states = [self.opt.state[m] for m in self.master]
        return [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], float(states[0]["step"])

    def facts(self) -> AdamFacts:
        """The settings and step count (0 before the first step)."""
        moments = self.moments()
        h = self.hyper
        return AdamFacts(h["lr"], tuple(h["betas"]), h["eps"], h["weight_decay"], moments[2] if moments else 0.0)

    def step(self) -> None:
        if self.opt is not None:
            grads = flat_grads(self.params)[self.lo: self.hi]
            offset = 0
            for m in self.master:
                m.grad = grads[offset: offset + m.numel()]
                offset += m.numel()
            self.opt.step()
            for m in self.master:
                m.grad = None
        _scatter_into(self._gather(), self.params, grads=False)

    def flat_master(self) -> torch.Tensor:
        return torch.cat([m.detach() for m in self.master]) if self.master else torch.zeros(0)

    def _gather(self) -> torch.Tensor:
        if _size(self.group) == 1:
            return self.flat_master()
        widest = max(hi - lo for lo, hi in self.bounds)
        mine = F.pad(self.flat_master(), (0, widest - (self.hi - self.lo)))
        parts = [torch.empty_like(mine) for _ in self.bounds]
        dist.all_gather(parts, mine, group=self.group)
        return torch.cat([p[: hi - lo] for p, (lo, hi) in zip(parts, self.bounds, strict=True)])

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: master segments plus the moments Adam has allocated."""
        total = sum(m.nbytes for m in self.master)
        if self.opt is not None:
            for state in self.opt.state.values():
                total += sum(v.nbytes for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
        return total
