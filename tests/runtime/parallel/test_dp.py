"""``ShardedAdam`` on one rank against torch's own optimizers: AdamW's decoupled weight decay (verl's
optimizer) and, with no decay, exactly Adam; the learning rate and decay set per step take effect."""

from __future__ import annotations

import torch

from nereus.runtime.parallel.dp import ShardedAdam


def _params() -> list[tuple[str, torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(0)
    return [("a", torch.nn.Parameter(torch.randn(3, 4, generator=g))),
            ("b", torch.nn.Parameter(torch.randn(5, generator=g)))]


def _grads(params: list[torch.nn.Parameter], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _run(make_reference, lrs: list[float], decays: list[float]) -> None:
    ours, theirs = _params(), _params()
    opt = ShardedAdam(ours, None, zero1=False, lr=lrs[0])
    ref = make_reference([p for _, p in theirs])
    for step, (lr, wd) in enumerate(zip(lrs, decays, strict=True)):
        _grads([p for _, p in ours], step)
        _grads([p for _, p in theirs], step)
        opt.set_lr(lr, wd)
        for group in ref.param_groups:
            group.update(lr=lr, weight_decay=wd)
        opt.step()
        ref.step()
        for (_, a), (_, b) in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a.data, b.data, rtol=0, atol=1e-7)


def test_weight_decay_is_adamw_and_none_is_adam():
    lrs = [0.0, 0.01, 0.02, 0.02]  # a warm-up: the first step at 0, as verl's schedule starts
    _run(lambda ps: torch.optim.AdamW(ps, lr=lrs[0], foreach=False), lrs, [0.1] * 4)
    _run(lambda ps: torch.optim.Adam(ps, lr=lrs[0], foreach=False), lrs, [0.0] * 4)
    # decay shrinks weights even where the gradient is zero (decoupled from the gradient, unlike Adam's L2)
    ps = _params()
    opt = ShardedAdam(ps, None, zero1=False, lr=0.1)
    for _, p in ps:
        p.grad = torch.zeros_like(p)
    before = [p.detach().clone() for _, p in ps]
    opt.set_lr(0.1, 0.5)
    opt.step()
    for b, (_, p) in zip(before, ps, strict=True):
        torch.testing.assert_close(p.data, b * (1 - 0.1 * 0.5))
