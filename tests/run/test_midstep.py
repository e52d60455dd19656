"""Mid-step moves of unfinished sequences between generation replicas in the RL step (run.rollout.midstep):
a step whose controller moves sequences — KV caches sent, or re-prefilled — gives the very tokens and
log-probs of the same step without moves; a migration that fails before its commit point moves nothing and
the step still ends with the same output; with ``run.overlap`` a step without moves starts inference on a
finished replica's rows and gets the sequential step's numbers; every decision lands in decisions.jsonl,
the run record and `nereus report`; the looks are sized from the forecast (a pure-function test).
Decisions use the cost model's priors (``calibrate: false``), so they do not depend on the machine's
timing; no timing is asserted."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from nereus.elastic.kvplan import KVShape
from nereus.run.job import RLJob
from nereus.run.midstep import MidStep, Replica, drain, gain_bound, slot_iterations, until_below
from nereus.runtime.recovery.faults import Fault, FaultPlan
from nereus.sim.report import write_report
from nereus.spec.errors import SpecError
from nereus.spec.run import MidstepSpec
from tests.run.jobs import tiny_job

# margin 0: any move the model predicts to shorten the step is admitted; trigger 1: a replica takes
# sequences as soon as it has a free slot; chunk 1: a look after every iteration once one has
FORCED = {"trigger": 1.0, "margin": 0.0, "chunk": 1, "calibrate": False}


def _same(a, b) -> None:
    for name in ("tokens", "gen_logp", "mask", "response_len", "finished"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.distributed
def test_midstep_moves_keep_rollouts_identical(ray_runtime, tmp_path):
    out = tmp_path / "run"
    job = tiny_job("ppo", str(out), steps=2, rollout={"slots": 2, "midstep": {"enabled": True, **FORCED}})
    # 32 rows a step, 16 per replica: the first look comes when a replica is forecast to fall under the
    # trigger (``MidStep.next_look``), and with the test job's 4 rows a replica the window for a move (one
    # replica under it, the other with two left) often closes within that look's forecast error
    job = replace(job, workload=replace(job.workload, prompts_per_step=16))
    rl = RLJob(job, runtime=ray_runtime, out_dir=out, quiet=True)
    try:
        rl.execute()
        st = rl.backend.stepper
        prompts = (st.prompts(0) + st.prompts(1))[8:24]  # 32 rows (16 per replica, 2 slots each): those
        # of the test job's steps 2-5 at its own 4 prompts a step, whose tails leave running sequences to move
        ctl = st.midstep
        st.midstep = None  # the same step without moves: the engine run to the end in one call
        base, _ = st.generate(2, prompts)
        for transfer in ("kv", "refill"):
            # KV moves as the rule admits them (margin 0); re-prefill forced: replaying a running sequence's
            # tokens costs more iterations than these short responses leave to gain, so the rule refuses it
            st.midstep = MidStep(MidstepSpec(**FORCED, transfer=transfer), force=transfer == "refill")
            moved, _ = st.generate(2, prompts)
            done = [d for d in st.midstep.take_decisions() if d.committed]
            assert done, transfer
            assert sum(d.kv if transfer == "kv" else d.refill for d in done) > 0  # running sequences moved
            assert sum(d.refill if transfer == "kv" else d.kv for d in done) == 0
            _same(base, moved)
        # a failure before the commit point, on both replicas' workers (nobody posts) or at install (after
        # every piece landed): the sequences stay where they were, and the step's output is unchanged
        for faults in ((Fault(0, "migration.transfer", "fail"), Fault(1, "migration.transfer", "fail")),
                       (Fault(1, "migration.install", "fail"),)):
            ray_runtime.inject(FaultPlan(faults))
            st.midstep = MidStep(MidstepSpec(**FORCED, transfer="kv"), force=True)
            failed, _ = st.generate(2, prompts)
            decisions = st.midstep.take_decisions()
            assert any(d.admitted and not d.committed and "aborted" in d.reason for d in decisions)
            _same(base, failed)
        _early_inference_kept_without_moves(st, prompts)
        st.midstep = ctl
    finally:
        rl.release()

    logged = [json.loads(line) for line in (out / "decisions.jsonl").read_text().splitlines()]
    moves = [d for d in logged if d["action"] == "midstep" and d["committed"]]
    assert moves and all(d["move_s"] > 0 and d["measured_gain_s"] is not None for d in moves)
    assert {"predicted_gain_s", "predicted_cost_s", "bytes", "kv", "refill", "iteration"} <= set(moves[0])
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["midstep/moves"] for m in metrics) == len(moves)
    record = json.loads((out / "run_record.json").read_text())
    mine = [d for d in logged if d["action"] == "midstep"]
    assert [d for d in record["decisions"] if d["action"] == "midstep"] == mine
    text = write_report([str(out / "run_record.json")], tmp_path / "report")["markdown"].read_text()
    assert "Mid-step decisions" in text and f"| {moves[0]['step']} | {moves[0]['iteration']} |" in text


def _early_inference_kept_without_moves(st, prompts) -> None:
    """With run.overlap + pad_to_max, mid-step steps without a committed move keep early inference."""
    # run.overlap + pad_to_max: inference starts on a finished replica's rows during the final call, as
    # on the plain engine, when no move committed (trigger 0: the final call is the whole generation),
    # and gives the sequential step's very numbers; a step whose moves committed starts none
    run = st.run
    st.run, st.midstep = replace(run, rollout_pad_to_max=True), None
    roll, rows = st.generate(2, prompts)
    sequential = st.infer(roll, rows)
    st.run, st.midstep = replace(run, overlap=True, rollout_pad_to_max=True), MidStep(MidstepSpec(trigger=0.0))
    early_roll, _ = st.generate(2, prompts)
    assert st.early is not None and any(st.early.early.values())
    _same(roll, early_roll)
    early = st.infer(early_roll, rows)
    assert early.keys() == sequential.keys() and all(torch.equal(early[k], sequential[k]) for k in early)
    st.midstep = MidStep(MidstepSpec(**FORCED, transfer="kv"))
    _same(roll, st.generate(2, prompts)[0])
    assert any(d.committed for d in st.midstep.take_decisions()) and st.early is None
    st.run = run


def test_midstep_keys_validated(tmp_path):
    with pytest.raises(SpecError, match=r"run\.rollout\.midstep\.enabled.*slots"):
        tiny_job("ppo", str(tmp_path), rollout={"midstep": {"enabled": True}})
    with pytest.raises(SpecError, match=r"run\.rollout\.midstep\.transfer"):
        tiny_job("ppo", str(tmp_path), rollout={"slots": 2, "midstep": {"enabled": True, "transfer": "copy"}})
    with pytest.raises(SpecError, match=r"run\.rollout\.midstep\.enabled.*dp=1"):
        tiny_job("ppo", str(tmp_path), rollout={"slots": 2, "midstep": {"enabled": True}},
                 layouts={"actor/generation": {"layout": "tp=2", "ranks": [0, 1]}})
    assert tiny_job("ppo", str(tmp_path)).run.rollout_midstep is None
    off = tiny_job("ppo", str(tmp_path), rollout={"slots": 2, "midstep": {"enabled": False}})
    assert off.run.rollout_midstep is None


def test_rule_replays_the_engine_schedule():
    # slots 2: [3, 1] run, the queued 2 takes the freed slot: rows 2 + 2 + 2 over 3 iterations
    assert drain([3, 1], [2], 2) == (6, 3)
    assert drain([], [], 4) == (0, 0)
    # caught up (cached = length - 1): one iteration per token left; caches dropped: prompt + replay first
    assert slot_iterations(prompt=5, generated=2, cached=6, final=4) == 2
    assert slot_iterations(prompt=5, generated=2, cached=0, final=4) == 4
    assert slot_iterations(prompt=5, generated=0, cached=0, final=3) == 3


def test_rule_moves_the_tail_only_when_it_pays():
    shape = KVShape(layers=2, kv_heads=2, head_dim=8, elem_bytes=4)
    rec = lambda i, g: [i, 4, g, 4 + g - 1, 16]  # noqa: E731 - a running sequence, caught up
    donor = Replica(0, [rec(0, 1), rec(1, 1)], [[2, 4, 0, 0, 16], [3, 4, 0, 0, 16]])
    receiver = Replica(1, [], [])
    ctl = MidStep(MidstepSpec(trigger=1.0, margin=0.0, calibrate=False, transfer="kv"))
    ctl.lengths.extend([20] * 8)  # the run's responses so far: 20 tokens each
    d, moves = ctl.decide(3, 7, [donor, receiver], [1.0, 1.0], slots=2, limit=32, shape=shape)
    assert d.admitted and d.donor == 0 and d.receiver == 1 and d.predicted_gain_s > 0
    assert [m.seq for m in moves] == [3, 2] and d.queued == 2 and d.bytes == 0  # the queue's back first
    # the same state under the default margin: the gain (in the 1 ms prior per row) is under 1.5 × 50 ms
    ctl = MidStep(MidstepSpec(trigger=1.0, calibrate=False))
    ctl.lengths.extend([20] * 8)
    d, _ = ctl.decide(3, 7, [donor, receiver], [1.0, 1.0], slots=2, limit=32, shape=shape)
    assert not d.admitted and "<=" in d.reason
    # nobody under the trigger: no decision
    assert MidStep(MidstepSpec(trigger=0.1, calibrate=False)).decide(
        3, 7, [donor, Replica(1, [rec(5, 1)], [])], [1.0, 1.0], slots=2, limit=32, shape=shape) is None


def test_looks_sized_from_the_forecast():
    # slots 2, [3, 1] run, 2 queued: after iteration 1 two are left (the 1 ended), after 3 none
    assert until_below([3, 1], [2], 2, below=3) == 1
    assert until_below([3, 1], [2], 2, below=1) == drain([3, 1], [2], 2)[1] == 3
    assert until_below([3, 1], [2], 2, below=5) == 0  # already fewer
    # forecast: the mean of the run's lengths above what a sequence has generated, within (g, limit]
    ctl = MidStep(MidstepSpec(trigger=0.5, margin=0.0, calibrate=False))
    ctl.lengths.extend([3, 5, 10])
    reps = [Replica(0, [[0, 4, 4, 7, 16]], [[1, 4, 0, 0, 16]]), Replica(1, [[2, 4, 10, 13, 16]], [])]
    assert ctl.final_lengths(reps, limit=12) == {0: 8, 1: 6, 2: 11}
    # slots 4, trigger 0.5: a replica receives under 2 unfinished; every sequence forecast at 4 tokens.
    # Replica 0 (6 queued) keeps 2 after iteration 4, none after 8; replica 1 (2 queued) none after 4:
    # the first look comes after 4 iterations, whatever the chunk
    ctl = MidStep(MidstepSpec(trigger=0.5, margin=0.0, chunk=1, calibrate=False))
    ctl.lengths.extend([4] * 8)
    queued = lambda ids: [[i, 3, 0, 0, 16] for i in ids]  # noqa: E731
    reps = [Replica(0, [], queued(range(6))), Replica(1, [], queued(range(6, 8)))]
    assert ctl.next_look(reps, None, slots=4, limit=8) == 4
    assert ctl.next_look(reps, [1e-3, 1e-3], slots=4, limit=8) == 4  # no stop rule before the window
    # one replica under the trigger: a look every ``chunk`` iterations while a move may pay
    drained = [Replica(0, [[i, 3, 1, 3, 16] for i in range(2)], queued(range(2, 6))), Replica(1, [], [])]
    assert ctl.next_look(drained, [1e-3, 1e-3], slots=4, limit=8) == 1
    # the default margin: even the perfect split (1 ms a row) gains less than 1.5 x a move's 50 ms: no more looks
    lazy = MidStep(MidstepSpec(trigger=0.5, chunk=1, calibrate=False))
    lazy.lengths.extend([4] * 8)
    assert lazy.next_look(drained, [1e-3, 1e-3], slots=4, limit=8) is None
    # no replica holds two unfinished sequences: no donor ever again
    assert ctl.next_look([Replica(0, [[0, 3, 1, 3, 16]], []), Replica(1, [], [])], None, 4, 8) is None
    # the bound: a perfect split of 10 rows gains 5; one 8-row sequence cannot be split: 2; no donor: 0
    assert gain_bound([10, 0], [4, 0], [1.0, 1.0], [True, False]) == 5.0
    assert gain_bound([10, 0], [8, 0], [1.0, 1.0], [True, False]) == 2.0
    assert gain_bound([10, 0], [4, 0], [1.0, 1.0], [False, False]) == 0.0
