import pytest
import yaml

from nereus.spec import SpecError, job_from_dict
from nereus.spec.trace import load_trace, trace_from_dict
from tests.conftest import EXAMPLES, ROOT


def good() -> dict:
    return {"source": "test", "steps": 100, "response_length": {"sigma": 0.5, "points": [
        {"step": 0, "mean": 100, "max": 400}, {"step": 100, "mean": 300, "max": 800}]},
        "gpus": [{"step": 0, "gpus": 8}, {"step": 50, "gpus": 16}], "failures": [{"step": 70, "gpus": 2}]}


def test_interpolation_staged_max_and_availability():
    t = trace_from_dict(good())
    assert t.response_at(50).mean == pytest.approx(200) and t.response_at(50).max == 400
    assert t.response_at(100).max == 800
    assert [t.gpus_at(s, 4) for s in (0, 49, 50, 69, 70)] == [8, 8, 16, 16, 14]


@pytest.mark.parametrize("mutate,pattern", [
    (lambda d: d.pop("source"), r"trace\.source: required key is missing"),
    (lambda d: d["response_length"]["points"][1].update(step=0), r"points\[1\]\.step: steps must increase"),
    (lambda d: d["response_length"]["points"][0].update(mean=-3), r"points\[0\]\.mean: -3.0 is out of range"),
    (lambda d: d["gpus"][0].update(gpu=3), r"trace\.gpus\[0\]\.gpu: unknown key; did you mean 'gpus'"),
    (lambda d: d.update(stepz=3), r"trace\.stepz: unknown key; did you mean 'steps'"),
])
def test_bad_traces_name_the_field(mutate, pattern):
    d = good()
    mutate(d)
    with pytest.raises(SpecError, match=pattern):
        trace_from_dict(d)


def test_job_workload_from_a_trace_step():
    spec = yaml.safe_load((EXAMPLES / "ppo_8b_h100.yaml").read_text())
    spec["workload"]["response_length"] = {"trace": str(ROOT / "traces" / "r1_zero_growth.yaml"), "step": 400}
    job = job_from_dict(spec)
    assert job.workload.response.max == 16384 and job.workload.response.mean == pytest.approx(6000)
    assert load_trace(ROOT / "traces" / "r1_zero_growth.yaml").source.startswith("DeepSeek-AI")
