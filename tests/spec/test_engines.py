"""The engines' declared traits (``spec.engines``): one table that the job config, the cost model, the policy
and the driver read, the published rows' engines resolved through it, and nothing outside the engine
packages naming an engine; the speculation lever's JSON unchanged by the n-gram lookup fields it gained."""

from __future__ import annotations

import csv
import json
from importlib import resources
from pathlib import Path

import pytest

import nereus
from nereus.devtools import seams
from nereus.spec.engines import DEFAULT_ENGINE, ENGINE_TRAITS, RUNNABLE, engine_traits, installed_distribution
from nereus.spec.levers import GenerationLevers, Speculation
from nereus.spec.rollout import ENGINES, RolloutEngine

PUBLISHED = ("decode_published.csv", "decode_small_batch.csv", "spec_decode_published.csv")  # engine columns


def test_the_job_config_offers_the_runnable_engines_and_native_is_the_default():
    assert ENGINES == RUNNABLE == ("native", "vllm") and DEFAULT_ENGINE == "native"
    assert RolloutEngine().traits is ENGINE_TRAITS["native"]
    native, vllm = ENGINE_TRAITS["native"], ENGINE_TRAITS["vllm"]
    # what the rest of the package asks instead of the engine's name
    assert (native.own_weights, native.restarts_on_move, vllm.own_weights, vllm.restarts_on_move) == (
        False, False, True, True)
    assert (native.migration, vllm.migration) == ("kv", "refill")
    assert (native.speculation, vllm.speculation) == ("live", "fixed")
    assert (native.slots(0), vllm.slots(0), vllm.slots(8)) == (0, 256, 8)
    assert native.runs_pp(4) and vllm.runs_pp(1) and not vllm.runs_pp(2)
    assert native.exact_logprobs and not vllm.exact_logprobs
    assert installed_distribution(native) is None  # part of Nereus: nothing to install


@pytest.mark.parametrize("name", PUBLISHED)
def test_every_published_row_names_an_engine_the_table_prices(name):
    text = resources.files("nereus.cost").joinpath(name).read_text()
    rows = list(csv.DictReader(line for line in text.splitlines() if not line.startswith("#")))
    for row in rows:
        assert engine_traits(row["engine"]).host is not None, row["engine"]
    with pytest.raises(KeyError, match="unknown engine"):
        engine_traits("an engine nobody published")


def test_only_the_job_config_and_the_traits_name_an_engine_outside_the_engine_packages():
    """The seam's rule on the package itself (``devtools.seams``): identifiers and string literals."""
    assert seams.engine_naming(Path(nereus.__file__).parent) == []


def test_speculation_json_keeps_its_fields_and_adds_the_lookup_only_when_set():
    plain, wide = Speculation("suffix", 4, 32), Speculation("ngram", 3, 8, prompt_lookup_max=5, prompt_lookup_min=2)
    assert plain.to_json() == {"draft": "suffix", "draft_tokens": 4, "live_at_most": 32}
    assert wide.to_json() == {"draft": "ngram", "draft_tokens": 3, "live_at_most": 8, "prompt_lookup_max": 5,
                              "prompt_lookup_min": 2}
    for s in (plain, wide):
        levers = GenerationLevers(speculation=s)
        assert GenerationLevers.from_dict(json.loads(json.dumps(levers.to_dict()))) == levers
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        Speculation("ngram", 3, 8, prompt_lookup_max=2, prompt_lookup_min=3)
