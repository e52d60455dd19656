"""The continuous-batching engine: each sequence's tokens and log-probs equal generating it alone (one
slot, no neighbours), whatever the number of slots, under greedy and sampled decoding, with per-sequence
EOS stop; greedy equals cache-free decoding of the plain model; TP, PP and DP replicas give the same
answers; dropped caches refilled by replay (bit-identical) or one re-prefill (equal to rounding)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nereus.runtime.cluster.launch import run_world
from nereus.runtime.engines.native.decode_engine import DecodeEngine, stream_seed
from nereus.runtime.engines.native.fixed_batch import reference_generate
from nereus.runtime.model.decoder import build_model
from tests.runtime.decode_helpers import (
    CFG,
    NEW,
    alone,
    answers,
    assert_same,
    layout,
    params,
    prompts,
    shard,
    share,
)

pytestmark = pytest.mark.rayless  # processes but no Ray: may run beside the Ray tests


def _batched(sm, ps, sp, slots: int):
    engine = DecodeEngine(sm, sp, slots)
    for i, p in enumerate(ps):
        engine.submit(i, p)
    busy = 0
    while not engine.idle:
        engine.step()
        busy = max(busy, len(engine.active))
    assert busy <= slots
    return answers(engine)


def _eos(sm) -> int:
    """A token prompt 0 meets as its 3rd greedy token, so some sequences stop early."""
    return alone(sm, prompts()[:1], params(False))[0][0][2]


def _single(rank: int, world: int) -> None:
    _, sm = shard(layout())
    ps = prompts()
    eos = _eos(sm)
    model = build_model(CFG, seed=1).double().eval()
    for sampled in (False, True):
        sp = params(sampled, eos)
        want = alone(sm, ps, sp)
        for slots in (2, 4):
            assert_same(_batched(sm, ps, sp, slots), want, exact=True)
        for i, (toks, lps) in want.items():
            assert len(toks) == NEW or toks[-1] == eos and eos not in toks[:-1], (i, toks)
            if not sampled:
                assert toks == reference_generate(model, ps[i], sp), i
            with torch.no_grad():
                full = torch.tensor([ps[i] + toks])
                ref = torch.log_softmax(model(full)[0, len(ps[i]) - 1:-1].double(), -1)
            ref = ref.gather(1, torch.tensor(toks)[:, None])[:, 0]
            assert torch.allclose(torch.tensor(lps, dtype=torch.float64), ref, atol=1e-6)
        if not sampled:  # prompt 0 stops at its EOS, others run to the length limit
            assert len(want[0][0]) <= 3 and any(len(t) == NEW for t, _ in want.values())
    sampled = alone(sm, ps, params(True))
    assert sampled != alone(sm, ps, params(False))  # the streams draw


def _dropped(sm, ps, sp, refill: str):
    """Drop every unfinished sequence's caches after 3 iterations, then finish."""
    engine = DecodeEngine(sm, sp, slots=3)
    for i, p in enumerate(ps):
        engine.submit(i, p)
    for _ in range(3):
        engine.step()
    engine.drop([s.seq_id for s in engine.unfinished()], refill)
    engine.run()
    return answers(engine)


def _refill(rank: int, world: int) -> None:
    _, sm = shard(layout())
    ps = prompts()
    for sampled in (False, True):
        sp = params(sampled)
        want = alone(sm, ps, sp)
        assert_same(_dropped(sm, ps, sp, "replay"), want, exact=True)
        assert_same(_dropped(sm, ps, sp, "prefill"), want, exact=False)


def test_each_sequence_generates_as_if_alone_whatever_the_slots():
    run_world(_single, 1, timeout_s=60)


def test_dropped_caches_refill_to_the_same_continuation():
    run_world(_refill, 1, timeout_s=60)


def _layouts(rank: int, world: int) -> None:
    _, ref_sm = shard(layout(), [0])
    ps = prompts()
    want = {}
    for sampled in (False, True):
        want[sampled] = share(alone(ref_sm, ps, params(sampled)) if rank == 0 else None)
    for lay, exact in ((layout(tp=2), False), (layout(pp=2), True), (layout(dp=2), True)):
        groups, sm = shard(lay)
        for sampled in (False, True):
            engine = DecodeEngine(sm, params(sampled), slots=2)
            ids = range(len(ps))[sm.replica_rows(len(ps))]
            for i in ids:
                engine.submit(i, ps[i])
            engine.run()
            assert_same(answers(engine), {i: want[sampled][i] for i in ids}, exact)
        dist.barrier()
        groups.destroy()


@pytest.mark.distributed
def test_tp_pp_and_dp_replicas_give_the_single_process_answers():
    run_world(_layouts, 2, timeout_s=120)


def test_stream_seeds_differ_per_sequence_and_seed():
    seeds = {stream_seed(s, i) for s in range(4) for i in range(50)}
    assert len(seeds) == 200 and all(0 <= x < 2**63 for x in seeds)
