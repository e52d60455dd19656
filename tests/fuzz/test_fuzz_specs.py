"""Fuzzing job specs and traces: any input is either accepted or refused with a SpecError that names a
key path — never another exception (bad input everywhere)."""

import copy
import math

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nereus.spec import SpecError, job_from_dict
from nereus.spec.trace import trace_from_dict
from tests.conftest import EXAMPLES, ROOT

SPECS = [yaml.safe_load(p.read_text()) for p in sorted(EXAMPLES.glob("*.yaml"))
         if "models" in yaml.safe_load(p.read_text())]
TRACES = [yaml.safe_load(p.read_text()) for p in sorted((ROOT / "traces").glob("*.yaml"))]

ATOMS = st.one_of(
    st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.sampled_from(["auto", "ppo", "H100", "full", "swiglu", "", "0"]),
)
VALUES = st.recursive(ATOMS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=6)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


@st.composite
def mutated(draw, bases):
    doc = copy.deepcopy(draw(st.sampled_from(bases)))
    for _ in range(draw(st.integers(1, 4))):
        paths = [p for p in _paths(doc) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "replace":
            parent[path[-1]] = draw(VALUES)
        elif action == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=10))] = draw(VALUES)
    return doc


def _refusal_names_a_key(err: SpecError) -> None:
    assert isinstance(err.path, str) and err.message


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(doc=mutated(SPECS))
def test_job_spec_fuzz_never_crashes(doc):
    try:
        job = job_from_dict(doc, EXAMPLES)
    except SpecError as err:
        _refusal_names_a_key(err)
        return
    assert job.sequences_per_step() > 0
    assert all(math.isfinite(a.params()) for a in job.models.values())


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(doc=mutated(TRACES), step=st.integers(0, 2000))
def test_trace_fuzz_never_crashes(doc, step):
    try:
        trace = trace_from_dict(doc)
    except SpecError as err:
        _refusal_names_a_key(err)
        return
    r = trace.response_at(step)
    assert 0 < r.mean <= r.max and trace.gpus_at(step, 8) >= 0
