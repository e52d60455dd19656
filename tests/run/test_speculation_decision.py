"""``SetSpeculation`` carried out by the runtime's engine loop: a policy switches n-gram speculation on at
the start of each step's generation (with decision points, ``run.rollout.midstep``); every replica's engine
speculates from then on, the decision lands in the run record as applied with the drafts counted so far,
and ``nereus run`` prints one progress line per switch. No timing is asserted."""

from __future__ import annotations

import pytest

from nereus.control.held import HeldPlan
from nereus.run.job import RLJob
from nereus.run.midstep import move_line
from nereus.spec.generation import END, GenerationDecision, GenerationEntry, GenerationStatus, SetSpeculation
from nereus.spec.levers import Speculation
from tests.run.jobs import tiny_job

SPEC = Speculation("ngram", 2, 64)


class SpeculateFromStart:
    def during_generation(self, status: GenerationStatus) -> GenerationDecision:
        return SetSpeculation(speculation=SPEC, gain_s=0.01, reason="test: speculate the whole step", look=END)


@pytest.mark.slow
@pytest.mark.distributed
def test_policy_switches_speculation_on_the_runtime(ray_runtime, tmp_path):
    job = tiny_job("grpo", str(tmp_path), steps=2, rollout={"slots": 4, "midstep": {"enabled": True,
                                                                                   "calibrate": False}})
    rl = RLJob(job, runtime=ray_runtime, out_dir=tmp_path, quiet=True)
    rl.policy = HeldPlan(rl.plan, rl.policy.replanner, name="speculate", generation=SpeculateFromStart())
    try:
        rl.execute()
    finally:
        rl.release()
    entries = [GenerationEntry.from_json(d) for d in rl.record.generation_decisions]
    assert [e.step for e in entries] == [0, 1]
    assert all(isinstance(e.decision, SetSpeculation) and e.decision.speculation == SPEC for e in entries)
    assert all(e.outcome.applied and e.outcome.figures["draft_tokens"] == 0.0 for e in entries)  # before any
    line = move_line(entries[0])
    assert line is not None and "speculation on (2 ngram drafts" in line and "step 1 after iteration 0" in line
