"""The levers as typed plan fields and inside-the-step decisions: JSON round trips, one-line errors, and
``run.policy_lag`` validated in job and trace files."""

import json

import pytest
import yaml

from nereus.spec import SpecError, job_from_dict
from nereus.spec.generation import (
    DECISION_KINDS,
    CarryOver,
    DeferSequences,
    NextLook,
    SetSpeculation,
    decision_from_json,
)
from nereus.spec.layout import Layout, ModelStage, Placement, Plan
from nereus.spec.levers import (
    AsyncSplit,
    GenerationLevers,
    PartialRollout,
    Speculation,
    TailBatching,
    check_policy_lag,
)
from nereus.spec.trace import trace_from_dict
from tests.conftest import EXAMPLES

LEVERS = GenerationLevers(Speculation("suffix", 4, 32), TailBatching(1.5), PartialRollout(4096), AsyncSplit(16),
                          "nereus", {"gain_s": 3.5})


def test_levers_round_trip_through_json_and_carry_their_policy_lag():
    back = GenerationLevers.from_dict(json.loads(json.dumps(LEVERS.to_dict())))
    assert back == LEVERS and back.predicted == {"gain_s": 3.5}
    assert LEVERS.policy_lag == 1 and LEVERS.any
    on_policy = GenerationLevers(Speculation("ngram", 3, 8), TailBatching(2.0))
    assert on_policy.policy_lag == 0 and not GenerationLevers().any
    assert GenerationLevers.from_dict(GenerationLevers().to_dict()) == GenerationLevers()


def test_a_plan_carries_its_levers_and_reads_them_back():
    p = Placement(ModelStage("actor", "generation"), Layout(tp=2, dp=2), (0, 1, 2, 3))
    plan = Plan((p,), 4, "colocated", levers=GenerationLevers(Speculation("draft_head", 2, 16)))
    back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back.levers == plan.levers and back == plan
    assert "generation_levers" not in Plan((p,), 4).to_dict()


@pytest.mark.parametrize(("bad", "path"), [
    ({"speculation": {"draft": "magic", "draft_tokens": 2, "live_at_most": 4}}, "generation_levers.speculation"),
    ({"speculation": {"draft": "ngram", "draft_tokens": 0, "live_at_most": 4}}, "generation_levers.speculation"),
    ({"tail_batching": {"over_launch": 0.5}}, "generation_levers.tail_batching"),
    ({"tail_batching": {"over_launch": 2, "when": "never"}}, "generation_levers.tail_batching.when"),
    ({"partial_rollout": {"round_tokens": -1}}, "generation_levers.partial_rollout"),
    ({"warp": {}}, "generation_levers.warp"),
])
def test_bad_levers_are_one_line_errors_naming_the_key(bad, path):
    with pytest.raises(SpecError) as err:
        GenerationLevers.from_dict({"format": "nereus.generation-levers/1", **bad})
    assert err.value.path == path and "\n" not in str(err.value)


def test_lever_decisions_are_decision_kinds_with_a_json_round_trip():
    for d in (SetSpeculation(speculation=Speculation("suffix", 5, 24), gain_s=1.5, look=NextLook(iterations=64)),
              SetSpeculation(speculation=None, reason="live batch too large"),
              DeferSequences(groups=12, gain_s=4.0), CarryOver(sequences=40, cost_s=0.2)):
        assert DECISION_KINDS[d.kind] is type(d) and d.acts
        assert decision_from_json(json.loads(json.dumps(d.to_json()))) == d


def _grpo_job(run_extra: dict) -> dict:
    data = yaml.safe_load((EXAMPLES / "grpo_longtail_tiny.yaml").read_text())
    data["run"] = {**data.get("run", {}), **run_extra}
    return data


def test_run_policy_lag_is_validated_with_a_one_line_error():
    assert check_policy_lag(1) == 1
    assert job_from_dict(_grpo_job({"policy_lag": 1}), EXAMPLES).run.policy_lag == 1
    assert job_from_dict(_grpo_job({}), EXAMPLES).run.policy_lag == 0
    for bad, says in ((2, "give 0"), (-1, "give 0"), (True, "integer")):
        with pytest.raises(SpecError) as err:
            job_from_dict(_grpo_job({"policy_lag": bad}), EXAMPLES)
        assert err.value.path == "run.policy_lag" and says in str(err.value) and "\n" not in str(err.value)


def test_a_trace_may_set_the_policy_lag_of_its_simulation():
    base = {"source": "test", "steps": 4, "response_length": {"points": [{"step": 0, "mean": 100, "max": 400}]}}
    assert trace_from_dict(base).policy_lag == 0
    assert trace_from_dict({**base, "policy_lag": 1}).policy_lag == 1
    with pytest.raises(SpecError, match="policy_lag"):
        trace_from_dict({**base, "policy_lag": 3})
