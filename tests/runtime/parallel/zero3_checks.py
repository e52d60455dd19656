"""ZeRO-3 layouts (``Layout.fsdp``) against the unsharded single-process reference, run inside the forked
world of ``test_layouts``: a rank keeps only its 1/dp range of its weights and gradients, outputs equal the
reference's, and a few Adam steps give the reference's weights and global gradient norm."""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.distributed as dist

from nereus.runtime.comm.groups import ParallelGroups
from nereus.runtime.model.decoder import ModelConfig, build_model
from nereus.runtime.model.hf import slice_boxes
from nereus.runtime.parallel.sharded import ShardedModel, shard_boxes, tied_head
from nereus.spec.layout import Layout
from tests.runtime.common import ADAM_EPS, BATCH, LR, batch, policy_loss

STEPS = 2  # the second step uses Adam moments the first left in the sharded state
TOL = dict(rtol=1e-4, atol=2e-5)


@lru_cache(maxsize=4)
def reference_steps(cfg: ModelConfig, mbs: int) -> dict:
    """The single model: its initial state, logits and, per Adam step, the gradient norm and the weights after."""
    model = build_model(cfg, seed=1)
    out = {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "norms": [], "stepped": []}
    b = batch(cfg)
    with torch.no_grad():
        out["logits"] = model(b.tokens)
    opt = torch.optim.Adam(model.parameters(), lr=LR, eps=ADAM_EPS, foreach=False)
    for _ in range(STEPS):
        opt.zero_grad()
        for i in range(0, BATCH, mbs):
            mb = b.select(slice(i, i + mbs))
            y = model(mb.tokens)
            if not cfg.value_head:
                y = torch.log_softmax(y, -1)[:, :-1].gather(-1, mb.tokens[:, 1:, None]).squeeze(-1)
            (policy_loss(y, mb) / (BATCH // mbs)).backward()
        out["norms"].append(torch.stack([p.grad.double().pow(2).sum() for p in model.parameters()]).sum().sqrt())
        opt.step()
        out["stepped"].append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def check_fsdp(cfg: ModelConfig, layout: Layout) -> None:
    """``layout`` (fsdp on) trains to the reference's weights; every rank of the world calls it."""
    groups = ParallelGroups(layout, tied_embeddings=tied_head(cfg))
    if groups.member:
        _check_member(cfg, groups)
    dist.barrier()
    groups.destroy()


def _check_resident(sm: ShardedModel, local: dict[str, torch.Tensor], where: str) -> None:
    """Outside a gather the rank holds no whole weight, only its 1/dp range of the flat weights and gradients
    (and, on a last pipeline stage of a tied model, the whole copy of the embedding it keeps as its head)."""
    whole = [p for n, p in sm.model.named_parameters() if n != "tied_head"]
    assert whole == [], (where, [tuple(p.shape) for p in whole])
    copy = sm.model.tied_head.nbytes if sm.model.tied_head is not None else 0
    total, dp = sum(t.numel() for n, t in local.items() if n != "tied_head"), sm.groups.dims.dp
    z = sm.zero3
    assert z.weights.numel() <= -(-total // dp) and z.grads.numel() == z.weights.numel(), (where, total, dp)
    report = sm.record_memory("train")
    assert report.parameters - copy == z.weights.nbytes <= -(-total // dp) * z.weights.element_size(), where


def _check_member(cfg: ModelConfig, groups: ParallelGroups) -> None:
    lay = groups.layout
    ref = reference_steps(cfg, lay.micro_batch_size)
    boxes = shard_boxes(cfg, groups)
    local = slice_boxes(ref["state"], boxes)
    sm = ShardedModel(cfg, groups, local)
    where = f"{lay.short()} rank {groups.rank}"
    _check_resident(sm, local, where)
    b = batch(cfg)
    logits = sm.logits(b.tokens)
    if logits is not None:
        rows = sm.replica_rows(len(b))
        torch.testing.assert_close(logits.cpu(), ref["logits"][rows], **TOL, msg=lambda m: f"{where}: {m}")
    for step in range(STEPS):
        sm.backward(b, policy_loss)
        _check_resident(sm, local, where)
        norm = sm.clip_gradients(1e9)  # far above the norm: measures, scales nothing
        torch.testing.assert_close(torch.tensor(norm, dtype=torch.float64), ref["norms"][step], rtol=1e-5, atol=0)
        sm.step(lr=LR, eps=ADAM_EPS)
        got = sm.shards()  # gathered over DP: every rank of the replica's DP group calls it
        if sm.model.tied_head is not None:  # the last stage's whole copy, synced from the first stage
            got["tied_head"] = sm.model.tied_head.detach()
        for name, t in slice_boxes(ref["stepped"][step], boxes).items():
            at = f"{where} step {step} {name}"
            torch.testing.assert_close(got[name].cpu(), t, **TOL, msg=lambda m, at=at: f"{at}: {m}")
