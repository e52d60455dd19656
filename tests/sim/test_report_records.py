"""`nereus report` checks every field of a run record's decisions inside the step (each decision kind's
fields, a declined move's too) and names each metrics.jsonl line or field it skips by file and line."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from nereus.sim.report import load_metrics, load_run
from nereus.spec.errors import SpecError
from nereus.spec.fields import MAX_STEPS
from tests.fuzz.cli_util import run_record

MOVE = {"kind": "move_sequences", "look": {"iterations": 0, "live_at_most": 0}, "reason": "gain",
        "moves": [{"seq": [1, 0, 12, 30, 42, 8, 50.0], "dst": 1, "refill": False}],
        "gain_s": 0.5, "cost_s": 0.1, "bytes": 1024}
GOOD = {
    "continue": {"kind": "continue", "reason": "too small", "declined": MOVE},
    "defer_sequences": {"kind": "defer_sequences", "groups": 2, "gain_s": 0.3, "cost_s": 0.0},
    "carry_over": {"kind": "carry_over", "sequences": 3, "gain_s": 0.3, "cost_s": 0.0},
    "move_sequences": MOVE,
}


def _record(tmp_path: Path, decision: dict) -> Path:
    entry = {"action": "generation", "step": 3, "model_stage": "actor/generation", "iteration": 4, "live": 6,
             "decision": decision, "overhead_s": 0.0,
             "outcome": {"applied": False, "reason": "", "cost_s": None, "gain_s": None, "figures": {}}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps({**run_record(), "generation_decisions": [entry]}))
    return path


@pytest.mark.parametrize("kind", GOOD)
def test_each_decision_kind_is_read(tmp_path, kind):
    load_run(_record(tmp_path, GOOD[kind]))


@pytest.mark.parametrize(("kind", "path", "value", "needle"), [
    ("defer_sequences", ("groups",), [2], "decision.groups: expected an integer"),  # a list for a count
    ("carry_over", ("sequences",), "3", "decision.sequences: expected an integer"),
    ("carry_over", ("gain_s",), [0.3], "decision.gain_s: expected a number"),  # a list for a gain
    ("carry_over", ("cost_s",), None, "decision.cost_s: is null"),
    ("continue", ("reason",), 5, "decision.reason: expected"),
    ("continue", ("declined", "gain_s"), [1], "decision.declined.gain_s: expected a number"),
    ("continue", ("declined", "bytes"), "1024", "decision.declined.bytes: expected an integer"),  # bytes as text
    ("continue", ("declined", "bytes"), -1, "decision.declined.bytes"),
    ("continue", ("declined", "moves"), 5, "decision.declined.moves: expected a list"),  # an int for a list
    ("continue", ("declined", "kind"), "carry_over", "decision.declined.kind"),
    ("move_sequences", ("moves",), 1, "decision.moves: expected a list"),
])
def test_a_malformed_decision_field_is_refused_naming_file_and_field(tmp_path, kind, path, value, needle):
    decision = copy.deepcopy(GOOD[kind])
    inner = decision
    for key in path[:-1]:
        inner = inner[key]
    inner[path[-1]] = value
    record = _record(tmp_path, decision)
    with pytest.raises(SpecError) as err:
        load_run(record)
    assert str(record) in str(err.value) and f"generation_decisions[0].{needle}" in str(err.value)


def test_bad_metrics_lines_and_fields_are_skipped_with_one_warning_each(tmp_path, capsys):
    record = tmp_path / "run_record.json"
    lines = ['{"step": 1, "actor/pg_loss": 0.1, "nereus/plan": "TP1"}', "not json", '{"step": "2"}', "[1]",
             '{"step": 3, "actor/pg_loss": [0.3], "critic/score/mean": 0.5}']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    rows = load_metrics(record)
    assert rows == [{"step": 1.0, "actor/pg_loss": 0.1}, {"step": 3.0, "critic/score/mean": 0.5}]
    warnings = capsys.readouterr().err.splitlines()
    where = tmp_path / "metrics.jsonl"
    assert warnings == [f"nereus: warning: {where}:2: not JSON; line skipped",
                        f"nereus: warning: {where}:3: step: expected a step number 0..{MAX_STEPS}, got '2'; line "
                        "skipped",
                        f"nereus: warning: {where}:4: step: expected a JSON object, got list; line skipped",
                        f"nereus: warning: {where}:5: actor/pg_loss: expected a finite number, got [0.3]; field "
                        "skipped"]


def test_warnings_about_metrics_are_bounded(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("x\n" * 50)
    assert load_metrics(tmp_path / "run_record.json") == []
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 6 and warnings[-1].endswith("metrics.jsonl: 45 more skipped")
