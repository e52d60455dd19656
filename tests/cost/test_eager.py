"""cost.eager: the host's dispatch of an eager decode step, and the published rows that say their rollout
ran eagerly (``enforce_eager``) pricing it in the engine's fixed step cost."""

from __future__ import annotations

import csv
from importlib import resources

import pytest

from nereus.cost.decode import DecodePriors
from nereus.cost.eager import EAGER_HOST_S_PER_KERNEL, eager_step_overhead_s
from nereus.cost.hardware import Hardware, Priors
from nereus.sim.published_predict import cost_times
from nereus.sim.published_runs import RowSkipped, published_run


def _row(run_id: str) -> dict:
    text = resources.files("nereus.cost").joinpath("e2e_runs.csv").read_text()
    rows = csv.DictReader(line for line in text.splitlines() if not line.startswith("#"))
    return next(r for r in rows if r["run_id"] == run_id)


def test_eager_dispatch_is_per_kernel_of_every_layer() -> None:
    per_layer = DecodePriors().kernels_per_layer * EAGER_HOST_S_PER_KERNEL
    assert eager_step_overhead_s(28) == pytest.approx(28 * per_layer)
    assert eager_step_overhead_s(56) == pytest.approx(2 * eager_step_overhead_s(28))


def test_an_eager_row_decodes_slower_than_the_same_row_with_graphs() -> None:
    eager = _row("verl_oso_3")
    assert eager["enforce_eager"] == "yes"
    graphed = {**eager, "enforce_eager": "no"}
    # a CSV without the column: the notes' verl version (July 2025) decides, before verl enabled graphs
    absent = {k: v for k, v in eager.items() if k != "enforce_eager"}
    run_e, run_g, run_a = published_run(eager), published_run(graphed), published_run(absent)
    step = Hardware(run_e.job.cluster).priors.decode_step_overhead_s
    assert step == pytest.approx(Priors().decode_step_overhead_s + eager_step_overhead_s(28))
    assert Hardware(run_g.job.cluster).priors.decode_step_overhead_s == Priors().decode_step_overhead_s
    gen_e, gen_g = (cost_times(r).stages["actor/generation"] for r in (run_e, run_g))
    assert gen_e > gen_g
    assert cost_times(run_a).stages == cost_times(run_e).stages
    later = {**absent, "notes": "version: main@~2025-10"}
    assert cost_times(published_run(later)).stages == cost_times(run_g).stages
    train_e, train_g = (cost_times(r).stages["actor/training"] for r in (run_e, run_g))
    assert train_e == pytest.approx(train_g)  # only the rollout decodes


def test_an_unknown_enforce_eager_value_skips_the_row() -> None:
    with pytest.raises(RowSkipped, match="enforce_eager"):
        published_run({**_row("verl_oso_3"), "enforce_eager": "sometimes"})
