"""Live migration of unfinished sequences mid-generation (``runtime.engines.native.kv_migrate``) on a gloo world of two
ranks: after TP1→TP2 (KV heads split), TP2→TP1 (merged), DP2→DP1 (gathered to one replica) and
worker→worker moves, and after dropping and re-prefilling, every sequence's tokens and log-probs equal an
uninterrupted generation, greedy and sampled (and after PP2→TP2 and TP2→PP2); a failure before the commit
point loses nothing. The migration plan is built from the sources' sequence records and crosses between
ranks as JSON."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from nereus.elastic.kvplan import GenPlacement, KVShape, MigrationPlan, SeqMove, plan_migration
from nereus.elastic.plan import KV_PIECE_KINDS, KV_STEP_KINDS
from nereus.runtime.cluster.launch import run_world
from nereus.runtime.comm.faults import FaultHook
from nereus.runtime.comm.transfer import TransferComm
from nereus.runtime.engines.native.decode_engine import DecodeEngine
from nereus.runtime.engines.native.kv_migrate import MigrationAborted, migrate
from tests.runtime.decode_helpers import CFG, alone, answers, assert_same, layout, params, prompts, shard, share

pytestmark = pytest.mark.rayless  # processes but no Ray: may run beside the Ray tests

SHAPE = KVShape(CFG.arch.layers, CFG.arch.kv_heads, CFG.arch.head_dim, 8)
BEFORE = 3  # iterations before the move: some sequences mid-generation, some still queued


def _start(sm, sp, slots: int = 3) -> DecodeEngine | None:
    """This replica's engine after ``BEFORE`` iterations over its rows of the prompts."""
    if sm is None:
        return None
    ps = prompts()
    engine = DecodeEngine(sm, sp, slots)
    for i in range(len(ps))[sm.replica_rows(len(ps))]:
        engine.submit(i, ps[i])
    for _ in range(BEFORE):
        engine.step()
    return engine


def _plan(engine, sm, src: GenPlacement, dst: GenPlacement, where, refill=lambda i: False) -> MigrationPlan:
    """Every rank builds the same plan from the records the sources' output ranks gather; ``where(i,
    replica)``: the destination replica of unfinished sequence i (None: it stays)."""
    mine = []
    if sm is not None and sm.is_output_rank:
        d = sm.groups.coords.dp_rank
        for info in engine.info(s.seq_id for s in engine.unfinished()):
            to = where(info.seq_id, d)
            if to is not None:
                mine.append(SeqMove(info.seq_id, info.prompt_len, info.generated, info.cached, info.rng_bytes, d,
                                    to, refill(info.seq_id)))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    moves = sorted((m for part in gathered for m in part), key=lambda m: m.seq)
    plan = plan_migration("actor", SHAPE, src, dst, moves)
    return MigrationPlan.from_json(json.loads(json.dumps(plan.to_json())))  # plans are data


def _finish(engines: list, want: dict, exact: bool) -> None:
    """Run the engines out; rank 0 checks the union of every output rank's finished sequences."""
    got = {}
    for engine in engines:
        if engine is not None:
            engine.run()
            if engine.sm.is_output_rank:
                got.update(answers(engine))
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, got)
    union = {k: v for p in parts for k, v in p.items()}
    if dist.get_rank() == 0:
        assert_same(union, want, exact)


def _change(rank: int, comm: TransferComm, want: dict, sampled: bool, lay_from: dict, lay_to: dict,
            refill=lambda i: False) -> None:
    """One replica moves every unfinished sequence to one replica of another layout on ranks 0.."""
    sp = params(sampled)
    placements = [GenPlacement(layout(**lay), tuple(range(layout(**lay).world))) for lay in (lay_from, lay_to)]
    (g_src, sm_src), (g_dst, sm_dst) = (shard(p.layout, list(p.ranks)) for p in placements)
    old = _start(sm_src, sp)
    new = DecodeEngine(sm_dst, sp, slots=3) if sm_dst is not None else None
    plan = _plan(old, sm_src, *placements, lambda i, d: 0, refill)
    migrate(plan, old, new, comm)
    assert old is None or not old.unfinished()
    # the finished sequences stay with the old engine's output rank; the rest finish on the new layout
    _finish([old, new], want, exact=False)
    for g in (g_src, g_dst):
        g.destroy()


def _dp_moves(rank: int, comm: TransferComm, want: dict, sampled: bool) -> None:
    """DP2→DP1 (replica 1's sequences gathered onto replica 0, which keeps running its own), then a
    worker→worker move back, half of it by re-prefill, on one DP2 placement."""
    sp = params(sampled)
    groups, sm = shard(layout(dp=2))
    two, one = GenPlacement(layout(dp=2), (0, 1)), GenPlacement(layout(), (0,))
    engine = _start(sm, sp, slots=2)
    plan = _plan(engine, sm, two, one, lambda i, d: 0 if d == 1 else None)
    assert any(s.src != s.dst for s in plan.sends())
    migrate(plan, engine, engine if rank == 0 else None, comm)
    assert rank == 0 or not engine.unfinished()
    for _ in range(2):
        engine.step()
    back = _plan(engine, sm, two, two, lambda i, d: 1 if d == 0 and i % 2 == 0 else None, lambda i: i % 4 == 0)
    migrate(back, engine, engine, comm)
    _finish([engine], want, exact=True)
    groups.destroy()


def _failure(rank: int, comm: TransferComm, want: dict, sampled: bool) -> None:
    """A destination failing after every piece landed, then a source failing before it sends (the
    destination's wait times out): both abort on both ranks, the sources keep everything; a third try
    commits."""
    sp = params(sampled)
    groups, sm = shard(layout(dp=2))
    two = GenPlacement(layout(dp=2), (0, 1))
    engine = _start(sm, sp, slots=2)
    held = {s.seq_id: (list(s.tokens), s.cached) for s in engine.unfinished()}
    plan = _plan(engine, sm, two, two, lambda i, d: 1 - d)
    for fault in ((1, "migration.install"), (0, "migration.transfer")):
        hook = FaultHook()
        if rank == fault[0]:
            hook.arm({fault[1]: "fail"})
        with pytest.raises(MigrationAborted, match="injected failure"):
            migrate(plan, engine, engine, comm, hook)
        assert {s.seq_id: (s.tokens, s.cached) for s in engine.unfinished()} == held
    result = migrate(plan, engine, engine, comm)
    assert sorted(result.released) == sorted(held) and len(result.installed) == len(engine.unfinished())
    _finish([engine], want, exact=True)
    groups.destroy()


def _body(rank: int, world: int, case: str) -> None:
    comm = TransferComm(timeout_s=3.0)
    _, ref = shard(layout(), [0])
    for sampled in (False, True):
        want = share(alone(ref, prompts(), params(sampled)) if rank == 0 else None)
        if case == "tp":
            _change(rank, comm, want, sampled, {"tp": 1}, {"tp": 2})  # KV heads split
            _change(rank, comm, want, sampled, {"tp": 2}, {"tp": 1})  # merged
            _change(rank, comm, want, sampled, {"pp": 2}, {"tp": 2})  # layers gathered, heads split
            _change(rank, comm, want, sampled, {"tp": 2}, {"pp": 2})  # heads merged, layers cut
            _change(rank, comm, want, sampled, {"tp": 1}, {"tp": 2}, refill=lambda i: i % 2 == 1)
        elif case == "dp":
            _dp_moves(rank, comm, want, sampled)
        else:
            _failure(rank, comm, want, sampled)
        dist.barrier()


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["tp", "dp", "failure"])
def test_migrated_sequences_continue_as_if_uninterrupted(case):
    run_world(_body, 2, case, timeout_s=120)


def test_a_migration_plan_has_every_kv_kind_and_round_trips():
    src = GenPlacement(layout(tp=2), (0, 1))
    dst = GenPlacement(layout(pp=2, dp=2), (2, 0, 3, 1))
    moves = [SeqMove(7, 5, 3, 7, 5056, 0, 1), SeqMove(9, 4, 0, 0, 5056, 0, 0, refill=True)]
    plan = plan_migration("actor", SHAPE, src, dst, moves)
    assert {s.kind for s in plan.steps} == set(KV_STEP_KINDS) | {"commit"}
    assert {p.kind for s in plan.steps for p in s.all_pieces()} == set(KV_PIECE_KINDS)
    assert MigrationPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    # sequence 7's caches reach replica 1 (ranks 0 and 1, stages 0 and 1) whole: every layer and head once
    # per destination rank, from the TP rank holding it
    for dst_rank, layers in ((0, (0, 2)), (1, (2, 3))):
        got = sorted((s.src, p.layers, p.heads) for s in plan.sends() if s.dst == dst_rank
                     for p in s.all_pieces() if p.kind == "kv")
        assert got == [(0, layers, (0, 1)), (1, layers, (1, 2))]
    assert plan.steps[plan.commit].deps == tuple(range(plan.commit))
    assert all(s.deps == (plan.commit,) for s in plan.steps[plan.commit + 1:])
    with pytest.raises(ValueError, match="format"):
        MigrationPlan.from_json({**plan.to_json(), "format": "x"})
    # one KV head replicated over TP 2: each destination takes it once, from its own rank when it holds it
    mqa = KVShape(2, 1, 8, 4)
    plan = plan_migration("actor", mqa, src, GenPlacement(layout(dp=2), (0, 1)), [SeqMove(1, 3, 2, 4, 8, 0, 1)])
    kv = [(s.src, s.dst, p.heads) for s in plan.sends() for p in s.all_pieces() if p.kind == "kv"]
    assert kv == [(1, 1, (0, 1))] and plan.bytes_sent == 0
