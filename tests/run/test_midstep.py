"""Mid-step moves of unfinished sequences between generation replicas in the RL step (run.rollout.midstep):
a step whose policy moves running sequences — KV caches sent, or re-prefilled — gives the very tokens and
log-probs of the same step without moves; a migration that fails before its commit point moves nothing and
the step still ends with the same output; with ``run.overlap`` a step without moves starts inference on a
finished replica's rows and gets the sequential step's numbers; every decision lands in decisions.jsonl,
the run record and `nereus report`; one policy object answers the decision points of the simulator and of
the runtime through the same ``Policy.during_generation``. No timing is asserted."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from nereus.control.backend import RunToEnd
from nereus.control.held import HeldPlan
from nereus.control.loop import run_policy
from nereus.run.job import RLJob
from nereus.runtime.comm.faults import Fault, FaultPlan
from nereus.sim.backend import SimBackend
from nereus.sim.generation import NOT_HERE
from nereus.sim.report import write_report
from nereus.spec.errors import SpecError
from nereus.spec.generation import (
    END,
    Continue,
    GenerationDecision,
    GenerationEntry,
    GenerationStatus,
    MoveSequences,
    NextLook,
    SequenceMove,
)
from nereus.spec.run import MidstepSpec
from nereus.spec.trace import LengthPoint, Trace
from tests.run.jobs import inferred, tiny_job

MIDSTEP = {"slots": 2, "midstep": {"enabled": True, "calibrate": False}}


class MoveRunning:
    """A generation policy that moves running sequences whatever the float stream: it looks after every
    iteration and, at the first look where a replica holds running sequences (caches built), moves every one
    of them to the next replica — their caches sent, or (``refill``) re-prefilled there — then looks no more.
    It keeps every status it was shown."""

    def __init__(self, refill: bool = False) -> None:
        self.refill, self.moved = refill, False
        self.statuses: list[GenerationStatus] = []

    def during_generation(self, status: GenerationStatus) -> GenerationDecision:
        self.statuses.append(status)
        if status.point == "start":
            self.moved = False
        donors = [r for r in status.replicas if any(s.cached for s in r.active)]
        if self.moved:
            return Continue()
        if status.point == "start" or not donors:
            return Continue(look=NextLook(iterations=1))
        self.moved = True
        dst = (donors[0].replica + 1) % len(status.replicas)
        moves = tuple(SequenceMove(s, dst, self.refill) for s in donors[0].active if s.cached)
        nbytes = 0 if self.refill else sum(status.kv_token_bytes * m.seq.cached for m in moves)
        return MoveSequences(moves=moves, bytes=nbytes, reason="test: move the running sequences", look=END)


def _same(a, b) -> None:
    for name in ("tokens", "gen_logp", "mask", "response_len", "finished"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def _moves(gen) -> list[GenerationEntry]:
    return [e for e in gen.entries if isinstance(e.decision, MoveSequences)]


@pytest.mark.distributed
def test_midstep_moves_keep_rollouts_identical(ray_runtime, tmp_path):
    out = tmp_path / "run"
    job = tiny_job("ppo", str(out), steps=2, rollout=MIDSTEP)
    job = replace(job, workload=replace(job.workload, prompts_per_step=16))  # 32 rows, 16 per replica
    rl = RLJob(job, runtime=ray_runtime, out_dir=out, quiet=True)
    rl.policy.generation = MoveRunning()  # the job's own policy: it moves running sequences every step
    try:
        rl.execute()
        st = rl.backend.rl_step
        prompts = st.generation.prompts(1)  # 32 rows, 16 a replica
        run = st.generation.run
        st.generation.run = replace(run, rollout_midstep=None)  # the same step without moves: the engine in one call
        base = st.generate(2, prompts).rollout
        st.generation.run = run
        for refill in (False, True):
            gen = st.generate(2, prompts, MoveRunning(refill))
            done = [e for e in _moves(gen) if e.outcome.applied]
            assert len(done) == 1 and len(done[0].decision.moves) >= 1, refill
            d = done[0].decision
            assert (d.refills if refill else d.kv) == len(d.moves)  # running sequences moved, as asked
            _same(base, gen.rollout)
        # a failure before the commit point, on both replicas' workers (nobody posts) or at install (after
        # every piece landed): the sequences stay where they were, and the step's output is unchanged
        for faults in ((Fault(0, "migration.transfer", "fail"), Fault(1, "migration.transfer", "fail")),
                       (Fault(1, "migration.install", "fail"),)):
            ray_runtime.inject(FaultPlan(faults))
            gen = st.generate(2, prompts, MoveRunning())
            assert any(not e.outcome.applied and "aborted" in e.outcome.reason for e in _moves(gen))
            _same(base, gen.rollout)
        _early_inference_kept_without_moves(st, prompts)
    finally:
        rl.release()
    _logged_and_reported(out, tmp_path)


def _logged_and_reported(out, tmp_path) -> None:
    """The run's moves in decisions.jsonl, the metrics, the run record and `nereus report`."""
    logged = [json.loads(line) for line in (out / "decisions.jsonl").read_text().splitlines()]
    mine = [d for d in logged if d["action"] == "generation"]
    moves = [GenerationEntry.from_json(d) for d in mine]
    assert len(moves) == 2 and all(e.outcome.applied and e.outcome.cost_s > 0 and e.outcome.gain_s is not None
                                   for e in moves)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["midstep/moves"] for m in metrics) == len(moves)
    record = json.loads((out / "run_record.json").read_text())
    assert record["generation_decisions"] == mine
    text = write_report([str(out / "run_record.json")], tmp_path / "report")["markdown"].read_text()
    assert "Decisions inside the step" in text and f"| {moves[0].step} | {moves[0].iteration} |" in text


def _early_inference_kept_without_moves(st, prompts) -> None:
    """With run.overlap + pad_to_max, a generation with decision points but no committed move keeps early
    inference on the final call (here the whole generation: the policy never looks) and gives the
    sequential step's very numbers; a step whose move committed starts none."""
    pieces = (st.generation, st.inference)  # the pieces of the step that read these keys
    runs = [p.run for p in pieces]

    def use(**keys: object) -> None:
        for p, run in zip(pieces, runs, strict=True):
            p.run = replace(run, **keys)

    use(rollout_pad_to_max=True, rollout_midstep=None)
    roll, rows = (g := st.generate(2, prompts)).rollout, g.rows
    sequential = inferred(st.inference.infer(roll, rows, g.early))
    use(overlap=True, rollout_pad_to_max=True)
    early_gen = st.generate(2, prompts, RunToEnd())
    assert early_gen.early is not None and any(early_gen.early.early.values())
    _same(roll, early_gen.rollout)
    early = inferred(st.inference.infer(early_gen.rollout, rows, early_gen.early))
    assert early.keys() == sequential.keys() and all(torch.equal(early[k], sequential[k]) for k in early)
    gen = st.generate(2, prompts, MoveRunning())
    _same(roll, gen.rollout)
    assert any(e.outcome.applied for e in _moves(gen)) and gen.early is None
    for p, run in zip(pieces, runs, strict=True):
        p.run = run


@pytest.mark.distributed
def test_one_policy_decides_inside_the_step_on_both_backends(ray_runtime, tmp_path):
    """One policy object (a fixed run's ``HeldPlan`` with a generation rule) runs two steps in the simulator
    and two on the Ray runtime; both backends call its ``during_generation`` at the start of each step's
    generation and at the look it asked for, with typed statuses, and record its move: carried out by the
    runtime, recorded as not carried out by the simulator (it prices tail layouts, not single moves)."""
    out = tmp_path / "run"
    job = tiny_job("ppo", str(out), steps=2, rollout=MIDSTEP)
    rl = RLJob(job, runtime=ray_runtime, out_dir=out, quiet=True)
    rule = MoveRunning()
    policy = HeldPlan(rl.plan, rl.policy.replanner, name="watch", generation=rule)
    trace = Trace("tiny", "two steps of the test job's lengths", 2, 0.5, (LengthPoint(0, 3.0, 4),))
    sim = run_policy(policy, SimBackend(job, trace), 2)
    simulated, rule.statuses = rule.statuses, []
    rl.policy = policy
    try:
        rl.execute()
    finally:
        rl.release()
    real = rule.statuses
    for statuses in (simulated, real):
        assert [s.point for s in statuses][:2] == ["start", "look"] and statuses[1].iteration >= 1
        assert {s.step for s in statuses} == {0, 1} and all(isinstance(s, GenerationStatus) for s in statuses)
        assert all(len(s.replicas) == 2 and s.model_stage == "actor/generation" for s in statuses)
    sim_moves = [GenerationEntry.from_json(d) for d in sim.generation_decisions]
    real_moves = [GenerationEntry.from_json(d) for d in rl.record.generation_decisions]
    assert len(sim_moves) == 2 and all(not e.outcome.applied and e.outcome.reason == NOT_HERE for e in sim_moves)
    assert len(real_moves) == 2 and all(e.outcome.applied for e in real_moves)
    assert all(isinstance(e.decision, MoveSequences) for e in sim_moves + real_moves)


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
    assert MidstepSpec().every == 1
