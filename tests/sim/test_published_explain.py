"""What a published run's prediction is made of (``sim.published_explain``, ``e2e_validation --explain``):
every column's written formula, evaluated from the seconds it prints, gives the predicted value, on every
modelled row of the packaged CSVs; the explanation names the empty cells a rule filled and the plan; the
command answers an unknown run id with a one-line error and a skipped row with its reason."""

from __future__ import annotations

import ast
import csv
import json
import operator
import re
import sys
from pathlib import Path

import pytest

from nereus.sim.published_explain import explain
from nereus.sim.published_predict import cost_times, predicted, predicted_parts
from nereus.sim.published_runs import RowSkipped, published_run
from tests.helpers import published_rows as rows

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import e2e_validation  # noqa: E402

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(node: ast.AST) -> float:
    """Sums, differences, products, quotients and max of numbers: nothing else is accepted."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return float(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        return OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "max":
        return max(_evaluate(a) for a in node.args)
    raise ValueError(f"not arithmetic: {ast.dump(node)}")


def arithmetic(how: str) -> float:
    """A formula as written (``generation 126.11 + driver 62.91; why``) with its words taken out, evaluated."""
    formula = how.split(";")[0]
    formula = re.sub(r"(?<=\d),(?=\d{3})", "", formula)  # thousands separators
    formula = re.sub(r"\bx\b", "*", formula)  # "s step x 16 GPUs"
    formula = re.sub(r"\b(?!max\b)[A-Za-z_][A-Za-z_/-]*", " ", formula)  # names of terms and mechanisms, units
    return _evaluate(ast.parse(formula.strip(), mode="eval"))


def modelled() -> list[tuple[str, dict]]:
    every = {**rows(), **rows("e2e_runs_nemo_rl.csv")}
    out = []
    for run_id, row in every.items():
        try:
            published_run(row)
        except RowSkipped:
            continue
        out.append((run_id, row))
    return out


@pytest.mark.parametrize(("run_id", "row"), modelled(), ids=lambda v: v if isinstance(v, str) else "")
def test_each_formula_gives_its_value(run_id: str, row: dict) -> None:
    run = published_run(row)
    device = cost_times(run)
    parts = predicted_parts(run, device)
    assert parts, run_id
    assert {c: p.value for c, p in parts.items()} == predicted(run, device)
    for column, part in parts.items():
        terms = len(re.findall(r"\d[\d,]*\.?\d*", part.how.split(";")[0]))
        assert arithmetic(part.how) == pytest.approx(part.value, rel=1e-3, abs=0.006 * terms), (column, part.how)


def test_the_explanation_names_the_rules_and_the_plan() -> None:
    row = rows()["verl_fa_6"]
    text = explain(row, published_run(row), "cost")
    assert "mean_response_len empty: 750 tokens" in text
    filled = text.splitlines()[2].split("empty cells a stated rule filled: ")[1].split(", ")
    assert {"mean_prompt_len", "mean_response_len", "reference"} <= set(filled)
    assert "weight sync checkpoint-engine" in text
    nemo = rows("e2e_runs_nemo_rl.csv")["nemorl_q30_32"]
    assert "at 0.6 of each GPU's memory" in explain(nemo, published_run(nemo), "cost")  # its framework's share
    assert "actor/generation       TP4 PP1 DP16 on 64 GPUs" in text
    assert "max(queue assembly" in text  # a streaming trainer's wait
    stated = {**row, "mean_response_len": "1500"}
    assert "mean_response_len empty" not in explain(stated, published_run(stated), "cost")


def test_offload_written_yes_is_named_with_the_empty_cells_its_rule_fills() -> None:
    row = {**rows()["verl_oso_1"], "offload": "yes"}
    filled = explain(row, published_run(row), "cost").splitlines()[2]
    assert filled.startswith("empty cells a stated rule filled:") and "offload" in filled


def test_a_weight_sync_row_reads_no_lengths() -> None:
    row = rows()["verl_wsync_3"]
    text = explain(row, published_run(row), "cost")
    assert "none read: the row times the weight sync alone" in text
    assert "device seconds" not in text
    assert "t_weight_sync_s" in text and "tensor-broadcast" in text


def test_the_command_explains_one_row(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    base = rows()["verl_oso_3"]
    odd = {**base, "run_id": "odd_gpu", "gpu": "other"}
    with (tmp_path / "runs.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(base))
        writer.writeheader()
        writer.writerows([base, odd])
    csv_path = str(tmp_path / "runs.csv")
    assert e2e_validation.main(["--rows", csv_path, "--explain", "verl_oso_3"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("verl_oso_3 (one_step_off.md): verl dapo, sync, colocated, 16 x H20")
    assert json.loads(out[-1])["rows"] == 1
    assert e2e_validation.main(["--rows", csv_path, "--explain", "odd_gpu"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("odd_gpu is skipped: ") and "gpu" in out[0]
    assert json.loads(out[-1])["rows"] == 0
    assert e2e_validation.main(["--rows", csv_path, "--explain", "no_such_run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("--explain: no row of ") and "'no_such_run'" in err and len(err.splitlines()) == 1


def test_the_simulator_source_is_explained_too() -> None:
    row = rows()["verl_oso_2"]
    text = explain(row, published_run(row), "sim")
    assert "device seconds (simulator truth; terms: the cost model's)" in text
    assert "the rollout worker's own generate_sequences timer" in text  # a one-step-off row's t_gen_s


@pytest.mark.parametrize(("written", "shown"), [("", "verl (framework empty: verl's defaults)"),
                                                ("slime", "slime (not listed: verl's defaults)"),
                                                ("verl v0.5", "verl v0.5 dapo")])
def test_a_framework_the_rules_do_not_list_is_named_as_priced_with_verls_defaults(written: str, shown: str) -> None:
    row = {**rows()["verl_fa_3"], "framework": written}
    header = explain(row, published_run(row), "cost").splitlines()[0]
    assert shown in header
    filled = explain(row, published_run(row), "cost").splitlines()[2]
    assert ("framework" in filled.split(": ", 1)[1].split(", ")) == (written == "")


@pytest.mark.parametrize("cell", ["algorithm", "critic", "placement", "rollout_engine", "train_backend",
                                  "n_kv_heads", "head_dim", "arch", "params_b", "max_prompt_len"])
def test_every_empty_cell_a_rule_fills_is_named(cell: str) -> None:
    """Leaving one of these empty prices the row by a stated rule (verl's defaults, the pools, a Hugging Face
    config's): the explanation says so rather than guessing silently."""
    row = {**rows()["verl_oso_4"], "mean_prompt_len": "256", cell: ""}
    filled = explain(row, published_run(row), "cost").splitlines()[2]
    assert cell in filled.split(": ", 1)[1].split(", ")


def filled_cells(row: dict) -> set[str]:
    return set(explain(row, published_run(row), "cost").splitlines()[2].split(": ", 1)[1].split(", "))


def test_a_weight_sync_row_names_no_batch_cells_among_those_filled() -> None:
    row = {**rows()["verl_wsync_7"], "checkpoint_engine": ""}
    filled = filled_cells(row)
    assert {"rollout_engine", "sync_mode", "checkpoint_engine"} <= filled
    assert not {"algorithm", "critic", "mean_prompt_len", "mean_response_len", "dynamic_bsz", "enforce_eager"} & filled
    assert not {"staleness", "partial_rollout", "enforce_eager"} & filled_cells(rows()["verl_wsync_1"])


def test_an_optional_setting_is_filled_only_where_neither_its_column_nor_the_notes_state_it() -> None:
    """verl_wsync_1's notes say ``checkpoint_engine=False``: stated, not filled; left out of both, verl's
    default for its mode is a rule's."""
    row = {**rows()["verl_wsync_1"], "checkpoint_engine": ""}  # the shared data set's row: no such column
    assert "checkpoint_engine" not in filled_cells(row)
    assert "checkpoint_engine" in filled_cells({**row, "notes": ""})
    fully_async = rows()["verl_fa_6"]
    assert {"partial_rollout", "checkpoint_engine", "enforce_eager"} <= filled_cells(
        {**fully_async, "partial_rollout": "", "checkpoint_engine": "", "enforce_eager": ""})
    assert "checkpoint_engine" not in filled_cells(rows()["verl_fa_3"])  # colocated: the hybrid engine's reshard
