"""Live transitions on the Ray workers: the actor's per-step training → generation weight sync, a layout
change of both stages at once while training continues, and a failed transition that leaves the job on
its old layout."""

from __future__ import annotations

import pytest
import torch

from nereus.runtime.comm.faults import FaultPlan
from nereus.runtime.comm.transfer import TransitionExecutionError
from tests.runtime.live_common import ACTOR, initial_state, job, lay, make_batch, spec

pytestmark = pytest.mark.distributed
TOL = {"rtol": 1e-4, "atol": 2e-5}


def loss(out, mb):  # module level: Ray ships it by reference
    return -(out * mb.advantages[:, 1:]).mean() + 0.1 * (out**2).mean()


def test_sync_transition_and_rollback_on_ray_workers(ray_runtime):
    rt, j = ray_runtime, job()
    state = initial_state("actor")
    train, gen = spec("actor", lay(tp=2, dp=2), [0, 1, 2, 3]), spec("actor", lay(dp=2), [2, 3], stage="generation")
    rt.load(train.key, ACTOR, train.layout, list(train.ranks), state=state)
    rt.load(gen.key, ACTOR, gen.layout, list(gen.ranks), state=state)
    try:
        tokens = make_batch(ACTOR, 0).tokens
        rt.train_step(train.key, make_batch(ACTOR, 1), loss, lr=1e-2)
        stale = rt.logprobs(gen.key, tokens)
        fresh = rt.logprobs(train.key, tokens)
        assert not torch.allclose(stale, fresh)  # training moved the weights
        out = rt.sync_weights("actor", j)
        assert out.wall_s > 0 and len(out.workers) == 4 and out.graph is not None
        torch.testing.assert_close(rt.logprobs(gen.key, tokens), fresh, **TOL)

        # both stages change layout and workers at once; Adam state moves with the training stage
        new = [spec("actor", lay(pp=2, dp=2), [3, 2, 1, 0]), spec("actor", lay(tp=4), [0, 1, 2, 3],
                                                                   stage="generation")]
        with pytest.raises(TransitionExecutionError, match="injected failure"):
            rt.inject(FaultPlan.fail(2, "transition.prepare"))
            rt.transition(new, j)
        torch.testing.assert_close(rt.logprobs(train.key, tokens), fresh, **TOL)  # still the old layout
        assert rt.specs[train.key].layout == train.layout
        result = rt.transition(new, j)
        assert rt.specs[train.key].layout == new[0].layout
        assert sum(w.bytes_received for w in result.workers) > 0
        torch.testing.assert_close(rt.logprobs(train.key, tokens), fresh, **TOL)
        torch.testing.assert_close(rt.logprobs(gen.key, tokens), fresh, **TOL)
        rt.train_step(train.key, make_batch(ACTOR, 2), loss, lr=1e-2)
        rt.sync_weights("actor", j)
        torch.testing.assert_close(rt.logprobs(gen.key, tokens), rt.logprobs(train.key, tokens), **TOL)
    finally:
        rt.release(train.key)
        rt.release(gen.key)


def test_workers_leave_and_join_without_losing_state(ray_runtime):
    """Shrink 4 → 3 workers (after moving off the last one) and grow back to 4: every worker re-forms the
    torch.distributed world, shards and Adam state stay in memory, training goes on."""
    rt, j = ray_runtime, job()
    train = spec("actor", lay(tp=2, dp=2), [0, 1, 2, 3])
    rt.load(train.key, ACTOR, train.layout, list(train.ranks), state=initial_state("actor"))
    try:
        tokens = make_batch(ACTOR, 0).tokens
        rt.train_step(train.key, make_batch(ACTOR, 1), loss, lr=1e-2)
        want = rt.logprobs(train.key, tokens)
        with pytest.raises(ValueError, match="transition off them"):
            rt.resize(3)
        rt.transition([spec("actor", lay(tp=2), [2, 0])], j)
        rt.resize(3)
        assert len(rt.workers) == 3
        torch.testing.assert_close(rt.logprobs(train.key, tokens), want, **TOL)
        rt.train_step(train.key, make_batch(ACTOR, 2), loss, lr=1e-2)
        stepped = rt.logprobs(train.key, tokens)
        rt.resize(4)
        torch.testing.assert_close(rt.logprobs(train.key, tokens), stepped, **TOL)
        rt.transition([spec("actor", lay(pp=2, dp=2), [0, 1, 2, 3])], j)
        torch.testing.assert_close(rt.logprobs(train.key, tokens), stepped, **TOL)
        rt.train_step(train.key, make_batch(ACTOR, 3), loss, lr=1e-2)
    finally:
        rt.resize(4)
        rt.release(train.key)


def test_a_sync_onto_coinciding_shards_moves_nothing_once_they_share_memory(ray_runtime):
    """Generation at the training layout and inference on one of its workers: the first sync aliases their
    shards onto the training ones, so Adam's in-place steps reach them and later syncs move nothing (no
    graph) yet leave every key equal to training; once a transition gives generation other boxes, the sync
    moves weights again."""
    rt, j = ray_runtime, job()
    state = initial_state("actor")
    train, gen = spec("actor", lay(dp=2), [0, 1]), spec("actor", lay(dp=2), [0, 1], stage="generation")
    inf = spec("actor", lay(), [1], stage="inference")
    for s in (train, gen, inf):
        rt.load(s.key, ACTOR, s.layout, list(s.ranks), state=state)
    try:
        tokens = make_batch(ACTOR, 0).tokens
        assert rt.sync_weights("actor", j).graph is not None  # loaded apart: the first sync aliases them
        for seed in (1, 2):
            rt.train_step(train.key, make_batch(ACTOR, seed), loss, lr=1e-2)
            out = rt.sync_weights("actor", j)
            assert out.graph is None and out.workers == ()
            fresh = rt.logprobs(train.key, tokens)
            assert torch.equal(rt.logprobs(gen.key, tokens), fresh) and torch.equal(rt.logprobs(inf.key, tokens), fresh)
        rt.transition([train, spec("actor", lay(tp=2), [0, 1], stage="generation"), inf], j)
        rt.train_step(train.key, make_batch(ACTOR, 3), loss, lr=1e-2)
        stale = rt.logprobs(gen.key, tokens)
        assert rt.sync_weights("actor", j).graph is not None
        fresh = rt.logprobs(train.key, tokens)
        assert not torch.allclose(stale, fresh)
        torch.testing.assert_close(rt.logprobs(gen.key, tokens), fresh, **TOL)
        assert torch.equal(rt.logprobs(inf.key, tokens), fresh)
    finally:
        for s in (train, gen, inf):
            rt.release(s.key)
