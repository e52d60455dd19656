"""Every layout with TP·PP·DP ≤ 4 against the single-process reference (design invariant 6): shard boxes,
logits, log-probs/values, gradients and one Adam step. One forked world of 4 ranks runs all layouts; the
groups of each layout are created by all 4 ranks and released afterwards."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from nereus.runtime.cluster.launch import run_world
from nereus.runtime.comm.groups import ParallelGroups
from nereus.runtime.model.hf import slice_boxes
from nereus.runtime.parallel.sharded import ShardedModel, shard_boxes, tied_head
from nereus.spec.layout import Layout
from nereus.spec.sharding import rank_tensors
from tests.runtime.common import ADAM_EPS, GQA, GQA_VALUE, LR, MQA, QWEN3, all_layouts, batch, policy_loss, reference
from tests.runtime.parallel.packed_checks import check_packed
from tests.runtime.parallel.zero3_checks import check_fsdp

pytestmark = [pytest.mark.distributed, pytest.mark.rayless]  # no Ray: may run beside the Ray tests
TOL = dict(rtol=1e-4, atol=2e-5)


def _msg(where: str):
    return lambda text: f"{where}: {text}"


def _cut(t: torch.Tensor, box) -> torch.Tensor:
    return t[tuple(slice(lo, hi) for lo, hi in box)]


def check_layout(cfg, layout, schedule: str = "1f1b") -> int | None:
    """``layout`` against the reference; this rank's activation peak of the training step (None off it)."""
    groups = ParallelGroups(layout, tied_embeddings=tied_head(cfg))
    peak = _check_member(cfg, groups, schedule) if groups.member else None
    dist.barrier()
    groups.destroy()
    return peak


def check_recompute(cfg, layout) -> None:
    """Selective and full recomputation train to the reference's gradients and weights, keeping fewer bytes
    for backward on every rank than without (full fewest: each layer keeps only its input)."""
    peaks = {mode: check_layout(cfg, replace(layout, recompute=mode)) for mode in ("none", "selective", "full")}
    if peaks["none"] is not None:
        assert peaks["full"] < peaks["selective"] < peaks["none"], (layout.short(), peaks)


def _check_member(cfg, groups: ParallelGroups, schedule: str) -> int:
    lay = groups.layout
    ref = reference(cfg, lay.micro_batch_size)
    boxes = shard_boxes(cfg, groups)
    sm = ShardedModel(cfg, groups, slice_boxes(ref["state"], boxes), schedule=schedule)
    contract = rank_tensors(cfg.arch, groups.dims, groups.rank, cfg.value_head)
    shards = sm.shards()
    assert set(shards) == set(contract), (lay.short(), set(shards) ^ set(contract))
    for name, p in shards.items():
        assert tuple(p.shape) == tuple(hi - lo for lo, hi in contract[name]), (lay.short(), name)
    b = batch(cfg)
    rows = sm.replica_rows(len(b))
    where = f"{lay.short()} rank {groups.rank} {schedule}"
    if cfg.value_head:
        got = sm.values(b.tokens)
        if got is not None:
            torch.testing.assert_close(got.cpu(), ref["fwd"]["values"][rows], **TOL, msg=_msg(where))
    else:
        logits, logp = sm.logits(b.tokens), sm.logprobs(b.tokens)
        assert (logits is None) == (not groups.last_stage)
        if logits is not None:
            torch.testing.assert_close(logits.cpu(), ref["fwd"]["logits"][rows], **TOL, msg=_msg(where))
            torch.testing.assert_close(logp.cpu(), ref["fwd"]["logprobs"][rows], **TOL, msg=_msg(where))
    sm.backward(b, policy_loss)
    for name, p in sm.model.named_parameters():
        src = "model.embed_tokens.weight" if name == "tied_head" else name
        want = _cut(ref["grad"][src], boxes[name])
        torch.testing.assert_close(p.grad.cpu(), want, **TOL, msg=_msg(f"grad {name} {where}"))
    _check_clipping(sm, ref, boxes, where)
    sm.step(lr=LR, eps=ADAM_EPS)
    for name, p in sm.model.named_parameters():
        src = "model.embed_tokens.weight" if name == "tied_head" else name
        torch.testing.assert_close(p.detach().cpu(), _cut(ref["stepped"][src], boxes[name]), **TOL,
                                   msg=_msg(f"weights {name} {where}"))
    return sm.last_report.activations


def _check_clipping(sm: ShardedModel, ref: dict, boxes: dict, where: str) -> None:
    """The global gradient norm equals the single model's (every element once), and clipping to half of
    it scales every local gradient as ``clip_grad_norm_`` scales the reference's; gradients restored."""
    saved = {n: p.grad.clone() for n, p in sm.model.named_parameters()}
    norm = sm.clip_gradients(1e9)  # far above the norm: measures, scales nothing
    torch.testing.assert_close(torch.tensor(norm, dtype=torch.float64), ref["grad_norm"], rtol=1e-5, atol=0,
                               msg=_msg(f"grad norm {where}"))
    sm.clip_gradients(norm / 2)
    scale = (norm / 2) / (norm + 1e-6)
    for name, p in sm.model.named_parameters():
        if name == "tied_head":
            continue  # follows the embedding after the step; not an optimizer parameter
        want = _cut(ref["grad"][name], boxes[name]) * scale
        torch.testing.assert_close(p.grad.cpu(), want, **TOL, msg=_msg(f"clipped grad {name} {where}"))
    for n, p in sm.model.named_parameters():
        p.grad = saved[n]


def _all_layouts_body(rank: int, world: int) -> None:
    torch.manual_seed(0)
    for layout in all_layouts(world):
        check_layout(MQA, layout)
    for layout in all_layouts(world):
        if layout.tp != 3:  # 4 heads / 2 KV heads: TP 3 cannot give each rank its KV heads
            check_layout(GQA, layout)
    for layout in [lay for lay in all_layouts(world) if lay.tp != 3 and lay.world >= 2]:
        check_layout(GQA_VALUE, layout)
    for layout in [lay for lay in all_layouts(world) if lay.tp in (2, 4) and lay.pp * lay.dp <= 2]:
        check_layout(QWEN3, layout)  # q/k norm gradients summed over TP (KV heads replicated at TP 4)
    # GPipe, ZeRO-1 off, and two sequences per micro-batch
    check_layout(MQA, replace(all_layouts(world)[0], tp=1, pp=2, dp=2), schedule="gpipe")
    check_layout(MQA, replace(all_layouts(world)[0], tp=2, pp=2, dp=1, micro_batch_size=2, zero1=False))
    check_layout(GQA, replace(all_layouts(world)[0], tp=1, pp=2, dp=2, micro_batch_size=2))
    # packed sequences in token-budget micro-batches, under TP, PP and DP
    check_packed(MQA, Layout(tp=2, pp=1, dp=2))
    check_packed(GQA, Layout(tp=2, pp=2, dp=1), budgets=(20,))
    check_packed(GQA_VALUE, Layout(tp=1, pp=2, dp=2), budgets=(12,))
    # activation recomputation (full: TP all-reduces recomputed in backward), padded and packed
    check_recompute(GQA, replace(all_layouts(world)[0], tp=2, pp=2, dp=1))
    check_packed(MQA, Layout(tp=2, pp=1, dp=2, recompute="full"), budgets=(20,))
    # ZeRO-3 (weights, gradients and Adam state sharded over DP) for a few steps: alone, under TP with q/k norm
    # gradients summed over TP and full recomputation gathering again in backward, under PP with a tied embedding
    check_fsdp(MQA, Layout(tp=1, pp=1, dp=4, fsdp=True, zero1=False, micro_batch_size=3))
    check_fsdp(QWEN3, Layout(tp=2, pp=1, dp=2, fsdp=True, zero1=False, recompute="full"))
    check_fsdp(GQA, Layout(tp=1, pp=2, dp=2, fsdp=True, zero1=False))


def test_every_layout_matches_single_process_reference():
    run_world(_all_layouts_body, 4, timeout_s=120)
