"""What the planner fills into layouts (planner.defaults) is what ``Layout``'s defaults and the job setup's
guess filled in before they moved here."""

from __future__ import annotations

import itertools
from dataclasses import replace

from nereus.planner.defaults import UNWRITTEN, generation_layout, runtime_options, written_options
from nereus.spec.capability import RuntimeCapability
from nereus.spec.layout import Layout

CAPABILITY = RuntimeCapability(recompute=("none",), sequence_parallel=False)  # the CPU runtime's


def test_a_generation_layout_is_the_one_the_planner_enumerated():
    for tp, pp, dp in itertools.product((1, 2, 4), (1, 2), (1, 3)):
        assert generation_layout(tp, pp, dp) == Layout(tp=tp, pp=pp, dp=dp, recompute="none", zero1=False)


def old_written(layout: Layout) -> Layout:
    """``run.setup._written`` as it was."""
    planner = Layout()
    own = {}
    if layout.recompute == planner.recompute:
        own["recompute"] = CAPABILITY.recompute[0]
    if layout.sequence_parallel == planner.sequence_parallel:
        own["sequence_parallel"] = CAPABILITY.sequence_parallel
    return replace(layout, **own)


def test_runtime_options_are_the_old_guess():
    assert UNWRITTEN == Layout()
    for text in ("tp=2", "tp=2,recompute=full", "tp=1,pp=2,sequence_parallel=false", "dp=2,recompute=selective",
                 "tp=2,recompute=none,sequence_parallel=true,zero1=false"):
        layout = Layout.parse(text)
        assert runtime_options(layout, CAPABILITY) == old_written(layout), text
    assert runtime_options(Layout.parse("tp=2"), CAPABILITY).recompute == CAPABILITY.recompute[0]


def test_written_options_split_the_degrees_from_the_other_fields():
    assert written_options("tp=8,pp=2,micro_batch_size=4,fsdp=true") == (
        {"tp": 8, "pp": 2}, {"micro_batch_size": 4, "fsdp": True})
