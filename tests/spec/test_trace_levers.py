"""The trace fields the tail levers read: acceptance rates of speculative drafts by kind and step, and the
prompt-level correlation of response lengths; every error names the field."""

import pytest

from nereus.spec import SpecError
from nereus.spec.trace import DRAFT_KINDS, load_trace, trace_from_dict
from tests.conftest import ROOT


def good() -> dict:
    return {"source": "test", "steps": 100,
            "response_length": {"sigma": 0.5, "points": [{"step": 0, "mean": 100, "max": 400}]},
            "acceptance": {"source": "vLLM issue 20780",
                           "suffix": [{"step": 0, "alpha": 0.6}, {"step": 50, "alpha": 0.8}],
                           "draft_head": [{"step": 10, "alpha": 0.75}]},
            "length_correlation": {"siblings": 0.4, "source": "Seer"}}


def test_acceptance_interpolates_between_points_and_holds_outside():
    t = trace_from_dict(good())
    assert [t.acceptance_at("suffix", s) for s in (0, 25, 50, 99)] == pytest.approx([0.6, 0.7, 0.8, 0.8])
    assert t.acceptance_at("draft_head", 0) == pytest.approx(0.75)  # before its first point: the first value
    assert t.acceptance_at("ngram", 5) is None  # no rate given for that kind
    assert t.sibling_correlation == pytest.approx(0.4)
    assert t.acceptance_source == "vLLM issue 20780" and t.correlation_source == "Seer"


def test_traces_without_the_sections_keep_their_defaults():
    d = good()
    del d["acceptance"], d["length_correlation"]
    t = trace_from_dict(d)
    assert t.acceptance == () and t.sibling_correlation == 0.0 and t.acceptance_at("suffix", 0) is None


ACC, COR = r"trace\.acceptance", r"trace\.length_correlation"


@pytest.mark.parametrize("mutate,pattern", [
    (lambda d: d["acceptance"].pop("source"), ACC + r"\.source: required key is missing"),
    (lambda d: d["acceptance"].update(medusa=[{"step": 0, "alpha": 0.5}]),
     ACC + r"\.medusa: unknown draft kind; use one of \['ngram', 'suffix', 'draft_model', 'draft_head'\]"),
    (lambda d: d["acceptance"]["suffix"][1].update(step=0), ACC + r"\.suffix\[1\]\.step: steps must increase"),
    (lambda d: d["acceptance"]["suffix"][0].update(alpha=1.2), ACC + r"\.suffix\[0\]\.alpha: 1.2 is out of range"),
    (lambda d: d["acceptance"]["suffix"][0].update(rate=0.5), ACC + r"\.suffix\[0\]\.rate: unknown key"),
    (lambda d: d["acceptance"].update(suffix=[]), ACC + r"\.suffix: give at least one \{step, alpha\} point"),
    (lambda d: d.update(acceptance={"source": "x"}), ACC + r": give acceptance points for at least one"),
    (lambda d: d["length_correlation"].update(siblings=1.5), COR + r"\.siblings: 1.5 is out of range"),
    (lambda d: d["length_correlation"].pop("source"), COR + r"\.source: required key is missing"),
    (lambda d: d["length_correlation"].update(sibling=0.3), COR + r"\.sibling: unknown key; did you mean"),
])
def test_bad_lever_fields_name_the_field(mutate, pattern):
    d = good()
    mutate(d)
    with pytest.raises(SpecError, match=pattern):
        trace_from_dict(d)


@pytest.mark.parametrize("name", ["long_tail_dapo", "r1_zero_growth", "deepscaler_stages"])
def test_long_tail_traces_carry_cited_acceptance_and_correlation(name):
    t = load_trace(ROOT / "traces" / f"{name}.yaml")
    assert {k for k, _ in t.acceptance} >= {"ngram", "suffix", "draft_head"}
    assert {k for k, _ in t.acceptance} <= set(DRAFT_KINDS)
    assert "vLLM" in t.acceptance_source and "Seer" in t.correlation_source
    assert 0 < t.sibling_correlation < 1
    for kind, _ in t.acceptance:
        assert all(0.4 <= t.acceptance_at(kind, s) <= 0.8 for s in range(0, t.steps, 50))
