"""Lost workers on the Ray runtime: a worker SIGKILLed in the middle of a training step with
DP = 2, and one killed in the middle of a live transition; the survivors re-form the world and carry on
from live data-parallel replicas and the host-memory snapshot."""

from __future__ import annotations

import pytest
import torch

from nereus.runtime.comm.faults import FaultPlan
from nereus.runtime.recovery.failover import WorkerLostError
from tests.runtime.live_common import ACTOR, REFERENCE, initial_state, job, lay, make_batch, spec

pytestmark = pytest.mark.distributed
TOL = {"rtol": 1e-4, "atol": 1e-5}
ADAM_LR = 1e-2


def loss(out, mb):  # module level: Ray ships it by reference
    return -(out * mb.advantages[:, 1:]).mean() + 0.1 * (out**2).mean()


def global_state(rt, key: str, model: str) -> dict:
    """(state, tensor, component) → the whole tensor, assembled from every worker of ``key``."""
    shapes = {k: tuple(v.shape) for k, v in initial_state(model).items()}
    full: dict = {}
    for held in rt.holdings(key):
        for (_, st, name, boxes), buf in held.buffers.items():
            for box in boxes:
                for i, v in enumerate(buf.view(box)):
                    t = full.setdefault((st, name, i), torch.full(shapes[name], float("nan"), dtype=v.dtype))
                    t[tuple(slice(lo, hi) for lo, hi in box)] = v
    for k, t in full.items():
        assert not torch.isnan(t).any(), f"{k} not covered"
    return full


def assert_states(got: dict, want: dict, exact: bool) -> None:
    assert set(got) == set(want)
    for k in want:
        if exact:
            assert torch.equal(got[k], want[k]), f"{k} differs"
        else:
            torch.testing.assert_close(got[k], want[k], **TOL, msg=lambda m, k=k: f"{k}: {m}")


def _load(rt, train, ref) -> None:
    rt.load(train.key, ACTOR, train.layout, list(train.ranks), state=initial_state("actor"))
    rt.load(ref.key, REFERENCE, ref.layout, list(ref.ranks), state=initial_state("reference"))


def _release(rt, keys) -> None:
    for k in keys:
        if k in rt.specs:
            rt.release(k)
    rt.resize(4)  # the session's runtime has four workers again for the tests that follow


def test_worker_killed_mid_step_with_dp2(ray_runtime):
    """Actor TP2×DP2 (Adam, ZeRO-1 over DP) and a frozen reference DP2 on 4 workers; worker 3 dies in the
    middle of its backward pass of step 3 (fault point ``backward``: its peers wait in the gradient
    all-reduce). The survivors restore the state of the step's start (the snapshot holds
    the lost ZeRO shard; the reference comes from its surviving replica), move to a 2-worker layout,
    redo the step, and hold what an uninterrupted run holds after it."""
    rt = ray_runtime
    train, ref = spec("actor", lay(tp=2, dp=2), [0, 1, 2, 3]), spec("reference", lay(dp=2), [1, 3])
    _load(rt, train, ref)
    try:
        for s in (1, 2):
            rt.train_step(train.key, make_batch(ACTOR, s), loss, lr=ADAM_LR)
        before = global_state(rt, train.key, "actor")
        rt.train_step(train.key, make_batch(ACTOR, 3), loss, lr=ADAM_LR)
        after = global_state(rt, train.key, "actor")  # the uninterrupted run after step 3
        rt.release(train.key)
        rt.release(ref.key)

        _load(rt, train, ref)  # the same run again, this time losing a worker in step 3
        for s in (1, 2):
            rt.train_step(train.key, make_batch(ACTOR, s), loss, lr=ADAM_LR)
        rt.snapshot(step=2)
        rt.inject(FaultPlan.kill(3, "backward"))
        with pytest.raises(WorkerLostError) as lost:
            rt.train_step(train.key, make_batch(ACTOR, 3), loss, lr=ADAM_LR)
        assert lost.value.lost == [3]

        new = [spec("actor", lay(pp=2), [2, 0]), spec("reference", lay(), [1])]
        out = rt.recover(lambda n: new)
        assert (out.lost, out.workers, out.resume_step) == ((3,), 3, 2)
        assert out.snapshot_only == ("actor",) and out.live_state == ("reference",)
        assert_states(global_state(rt, train.key, "actor"), before, exact=True)  # bit-equal step-start state
        assert_states(global_state(rt, ref.key, "reference"),
                      {("weights", k, 0): v for k, v in initial_state("reference").items()}, exact=True)

        rt.train_step(new[0].key, make_batch(ACTOR, 3), loss, lr=ADAM_LR)  # redo the lost step
        assert_states(global_state(rt, train.key, "actor"), after, exact=False)
        rt.train_step(new[0].key, make_batch(ACTOR, 4), loss, lr=ADAM_LR)  # and go on
    finally:
        _release(rt, [train.key, ref.key])


def test_worker_killed_mid_transition(ray_runtime):
    """Worker 2 dies while a transition's transfers run: the survivors drop the half-built layout and come
    back on a consistent one — weights from live replicas, the lost ZeRO shard from the snapshot — equal
    to the state before the transition, and training goes on."""
    rt, j = ray_runtime, job()
    train, ref = spec("actor", lay(tp=2, dp=2), [0, 1, 2, 3]), spec("reference", lay(dp=2), [2, 3])
    _load(rt, train, ref)
    try:
        rt.train_step(train.key, make_batch(ACTOR, 1), loss, lr=ADAM_LR)
        rt.snapshot(step=1)
        before = global_state(rt, train.key, "actor")
        rt.inject(FaultPlan.kill(2, "transition.transfer"))
        with pytest.raises(WorkerLostError) as lost:
            rt.transition([spec("actor", lay(pp=2, dp=2), [3, 2, 1, 0])], j)
        assert lost.value.lost == [2]
        out = rt.recover(lambda n: [spec("actor", lay(tp=2), [2, 0]), spec("reference", lay(), [2])])
        assert out.live_state == ("actor", "reference") and out.snapshot_only == ()
        assert_states(global_state(rt, train.key, "actor"), before, exact=True)
        rt.train_step(train.key, make_batch(ACTOR, 2), loss, lr=ADAM_LR)
    finally:
        _release(rt, [train.key, ref.key])


def test_worker_killed_mid_weight_sync(ray_runtime):
    """The per-step weight sync (``sync_weights``: the trained actor's weights to its generation layout, through
    the transition executor) loses worker 1 in its transfers (``sync.transfer``): the survivors come back on the
    snapshot's state — the step redone from there holds what an uninterrupted step and sync hold, and the
    generation key follows the training key."""
    rt, j = ray_runtime, job()
    train = spec("actor", lay(tp=2, dp=2), [0, 1, 2, 3])
    gen = spec("actor", lay(dp=2), [1, 2], stage="generation")

    def load() -> None:
        for s in (train, gen):
            rt.load(s.key, ACTOR, s.layout, list(s.ranks), state=initial_state("actor"))

    load()
    try:
        rt.train_step(train.key, make_batch(ACTOR, 1), loss, lr=ADAM_LR)
        rt.sync_weights("actor", j)
        want = global_state(rt, gen.key, "actor")  # the uninterrupted step and sync
        for key in (train.key, gen.key):
            rt.release(key)

        load()
        rt.snapshot(step=0)
        rt.train_step(train.key, make_batch(ACTOR, 1), loss, lr=ADAM_LR)
        rt.inject(FaultPlan.kill(1, "sync.transfer"))
        with pytest.raises(WorkerLostError) as lost:
            rt.sync_weights("actor", j)
        assert lost.value.lost == [1]
        new_train, new_gen = spec("actor", lay(tp=2), [0, 2]), spec("actor", lay(), [1], stage="generation")
        out = rt.recover(lambda n: [new_train, new_gen])
        assert (out.lost, out.workers, out.resume_step) == ((1,), 3, 0)
        rt.train_step(train.key, make_batch(ACTOR, 1), loss, lr=ADAM_LR)  # the lost step, redone
        rt.sync_weights("actor", j)
        got = global_state(rt, gen.key, "actor")
        assert_states(got, want, exact=False)
        assert_states(got, {k: v for k, v in global_state(rt, train.key, "actor").items() if k in got}, exact=True)
    finally:
        _release(rt, [train.key, gen.key])


def test_generation_worker_killed_mid_decode(ray_runtime):
    """The native engine's replica on worker 1 dies after its first decode iteration (``generate``): the
    survivors re-form the world and generate the same greedy rows from the same weights."""
    from nereus.runtime.engines.sampling import SamplingParams

    rt = ray_runtime
    gen = spec("actor", lay(dp=2), [0, 1], stage="generation")
    rt.load(gen.key, ACTOR, gen.layout, list(gen.ranks), state=initial_state("actor"))
    try:
        prompts, params = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]], SamplingParams(max_new_tokens=5)
        want = rt.generate_with_logprobs(gen.key, prompts, params)
        rt.snapshot(step=0)
        rt.inject(FaultPlan.kill(1, "generate"))
        with pytest.raises(WorkerLostError) as lost:
            rt.generate_with_logprobs(gen.key, prompts, params)
        assert lost.value.lost == [1]
        out = rt.recover(lambda n: [spec("actor", lay(), [2], stage="generation")])
        assert out.live_state == ("actor",)  # from the surviving replica: nothing from the snapshot
        got = rt.generate_with_logprobs(gen.key, prompts, params)
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
        for (_, a), (_, b) in zip(got, want, strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), **TOL)
    finally:
        _release(rt, [gen.key])


def test_a_snapshot_whose_lost_image_failed_gives_way_to_the_one_before(ray_runtime):
    """A worker lost before its image of the newest snapshot was in: recovery settles on the snapshot before,
    and every trained model comes from it (their live state has changed since); a lost worker whose image
    is in leaves the newest snapshot in force, with nothing taken from it."""
    import ray

    from nereus.runtime.recovery.failover import Failover, PendingSnapshot

    @ray.remote(num_cpus=0)  # the runtime's workers hold the CPUs
    def image(ok: bool) -> bytes:
        if not ok:
            raise RuntimeError("the worker died before its image was in")
        return b"image"

    specs = [spec("actor", lay(dp=2), [0, 1]), spec("reference", lay(dp=2), [0, 1])]

    def failover(newest_ok: bool) -> Failover:
        f = Failover()
        f.snapshots, f.snapshot_step = {m: [ray.put(b"old"), ray.put(b"old")] for m in ("actor", "reference")}, 3
        f._pending = PendingSnapshot(4, {"actor": [image.remote(True), image.remote(newest_ok)]}, {})
        return f

    fell_back = failover(newest_ok=False)
    assert fell_back.recovery_sources([], specs, lost=[1]) == {"actor"} and fell_back.snapshot_step == 3
    kept = failover(newest_ok=True)
    assert kept.recovery_sources([], specs, lost=[1]) == set() and kept.snapshot_step == 4
