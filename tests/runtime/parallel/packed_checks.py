"""Packed layouts (``Layout.max_token_len``) against the padded single-process reference: log-probs or
values past each row's length are 0 and equal elsewhere; the token-mean objective and its gradients are
the same whatever the token budget splits the mini-batch into (and however DP deals its rows)."""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import torch
import torch.distributed as dist

from nereus.runtime.comm.groups import ParallelGroups
from nereus.runtime.model.decoder import ModelConfig, build_model
from nereus.runtime.model.hf import slice_boxes
from nereus.runtime.parallel.batch import TrainBatch
from nereus.runtime.parallel.sharded import ShardedModel, shard_boxes, tied_head
from nereus.spec.layout import Layout
from nereus.spec.packing import replica_shares

ROWS, WIDTH = 8, 12
TOL = dict(rtol=1e-4, atol=2e-5)


def packed_batch(cfg: ModelConfig) -> TrainBatch:
    """Right-padded rows of lengths 2..12 with token-mean weights over the real next tokens (or values)."""
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.arch.vocab, (ROWS, WIDTH), generator=g)
    lengths = torch.tensor([12, 3, 7, 2, 12, 5, 9, 4])
    frame = WIDTH if cfg.value_head else WIDTH - 1
    mask = (torch.arange(frame)[None] < (lengths[:, None] - (0 if cfg.value_head else 1))).float()
    return TrainBatch(tokens, weight=mask * ROWS / mask.sum(), advantages=torch.randn(ROWS, frame, generator=g),
                      returns=torch.randn(ROWS, frame, generator=g), lengths=lengths)


def token_mean_loss(out: torch.Tensor, mb: TrainBatch) -> torch.Tensor:
    """Σ weight·ℓ / rows (the form of ``rl.losses``): a policy-gradient-shaped term, or value regression."""
    if out.shape[-1] == mb.tokens.shape[-1]:
        x = (out - mb.returns) ** 2
    else:
        x = -out * mb.advantages + 0.1 * out**2
    return (x * mb.weight).sum() / len(x)


@lru_cache(maxsize=4)
def packed_reference(cfg: ModelConfig) -> dict:
    """The padded single model: outputs (0 past each row's length), objective and gradients."""
    model = build_model(cfg, seed=1)
    b = packed_batch(cfg)
    y = model(b.tokens)
    if not cfg.value_head:
        y = torch.log_softmax(y, -1)[:, :-1].gather(-1, b.tokens[:, 1:, None]).squeeze(-1)
    loss = token_mean_loss(y, b)
    loss.backward()
    keep = b.weight > 0
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "out": y.detach() * keep,
            "keep": keep, "loss": float(loss.detach()),
            "grad": {k: p.grad.clone() for k, p in model.named_parameters()}}


def check_packed(cfg: ModelConfig, layout: Layout, budgets: tuple[int, ...] = (12, 20, 1000)) -> None:
    """``layout`` with each token budget against ``packed_reference`` (all ranks of the world call it)."""
    for budget in budgets:
        groups = ParallelGroups(replace(layout, max_token_len=budget), tied_embeddings=tied_head(cfg))
        if groups.member:
            _check(cfg, groups, f"{layout.short()} budget {budget} rank {groups.rank}")
        dist.barrier()
        groups.destroy()


def _check(cfg: ModelConfig, groups: ParallelGroups, where: str) -> None:
    ref, b = packed_reference(cfg), packed_batch(cfg)
    boxes = shard_boxes(cfg, groups)
    sm = ShardedModel(cfg, groups, slice_boxes(ref["state"], boxes))
    rows = replica_shares(b.lengths.tolist(), groups.dims.dp)[groups.coords.dp_rank]  # dealt by tokens
    got = sm.values(b.tokens, b.lengths) if cfg.value_head else sm.logprobs(b.tokens, b.lengths)
    if got is not None:
        torch.testing.assert_close(got * ref["keep"][rows], ref["out"][rows], **TOL, msg=lambda m: f"{where}: {m}")
        torch.testing.assert_close(got[~ref["keep"][rows]], torch.zeros_like(got[~ref["keep"][rows]]))
    losses = sm.backward(b, token_mean_loss)
    mbs = sm.packed_micro_batches(b)
    assert all(p.tokens <= groups.layout.max_token_len or len(p.lengths) == 1 for _, p in mbs), where
    if sm.is_output_rank:  # the objective: each micro-batch's loss by its share of the mini-batch's rows
        part = torch.tensor(sum(x * len(mb) for x, (mb, _) in zip(losses, mbs, strict=True)) / len(b))
        dist.all_reduce(part, group=groups.dp_group)
        torch.testing.assert_close(float(part), ref["loss"], **TOL, msg=lambda m: f"loss {where}: {m}")
    for name, p in sm.model.named_parameters():
        src = "model.embed_tokens.weight" if name == "tied_head" else name
        want = ref["grad"][src][tuple(slice(lo, hi) for lo, hi in boxes[name])]
        torch.testing.assert_close(p.grad, want, **TOL, msg=lambda m, n=name: f"grad {n} {where}: {m}")
