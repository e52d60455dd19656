"""Data parallelism: gradient averaging over the DP group and Adam with ZeRO-1 sharded state.

``ShardedAdam`` keeps fp32 master weights and Adam's two moments (12 bytes per parameter, the cost
model's ``OPTIMIZER_BYTES_PER_PARAM``) for this rank's contiguous share of its flattened local parameters:
all of them without ZeRO-1, a ``split_range`` 1/dp share with it (Rajbhandari et al. 2020, P_os). After
the step the updated shares are all-gathered over DP and copied into the model's parameters. Adam is
elementwise, so the sharded update equals the unsharded one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nereus.spec.sharding import split_range


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
    """Adam (``torch.optim.Adam`` on an fp32 master shard) over ``params``, state sharded over ``group``
    when ``zero1``. Every rank of ``group`` must call ``step`` together."""

    def __init__(self, params: list[torch.nn.Parameter], group: dist.ProcessGroup | None, zero1: bool,
                 lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        self.params = list(params)
        self.group = group if zero1 else None
        self.numel = sum(p.numel() for p in self.params)
        n = _size(self.group)
        index = dist.get_rank(self.group) if n > 1 else 0
        self.bounds = [split_range(self.numel, n, i) for i in range(n)]
        self.lo, self.hi = self.bounds[index]
        with torch.no_grad():
            flat = torch.cat([p.reshape(-1).float() for p in self.params]) if self.params else torch.zeros(0)
            self.master = flat[self.lo: self.hi].clone()
        self.opt = torch.optim.Adam([self.master], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                    foreach=False)

    def step(self) -> None:
        self.master.grad = flat_grads(self.params)[self.lo: self.hi].clone() if self.params else None
        self.opt.step()
        self.master.grad = None
        _scatter_into(self._gather(), self.params, grads=False)

    def _gather(self) -> torch.Tensor:
        if _size(self.group) == 1:
            return self.master.detach()
        widest = max(hi - lo for lo, hi in self.bounds)
        mine = F.pad(self.master.detach(), (0, widest - self.master.numel()))
        parts = [torch.empty_like(mine) for _ in self.bounds]
        dist.all_gather(parts, mine, group=self.group)
        return torch.cat([p[: hi - lo] for p, (lo, hi) in zip(parts, self.bounds, strict=True)])

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: master shard plus the moments Adam has allocated."""
        total = self.master.nbytes
        for state in self.opt.state.values():
            total += sum(v.nbytes for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
        return total
