"""Data files checked by name before anything heavy imports (``spec.data_files``): a missing Parquet file is
refused at once, under the key as typed, with torch, Ray and the data readers unimportable."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nereus.cli import main
from nereus.spec.data_files import check_data_files
from nereus.spec.errors import SpecError
from nereus.spec.job import load_job

GRPO = Path(__file__).resolve().parents[2] / "examples" / "grpo_tiny.yaml"
HEAVY = ("torch", "ray", "transformers", "pyarrow", "pyarrow.parquet", "pandas", "vllm", "nereus.run.job")


@pytest.fixture
def nothing_heavy(monkeypatch):
    """``import torch`` (and the others) raises ImportError: a refusal that needed them would say so."""
    for name in HEAVY:
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.parametrize("extra", [[], ["--cfg", "job"]])
def test_a_missing_parquet_file_is_refused_before_anything_heavy(nothing_heavy, extra, capsys, tmp_path):
    out = tmp_path / "out"
    assert main(["run", str(GRPO), "data.train_files=/no/such.parquet", "--out", str(out), *extra]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("nereus: error: data.train_files: '/no/such.parquet' does not exist")
    assert line.endswith("(run.data.train in Nereus's terms)")
    assert not out.exists()  # refused before the output folder is made


def test_each_file_of_a_list_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text("{}\n")
    (tmp_path / "rows.csv").write_text("a\n")
    (tmp_path / "folder.jsonl").mkdir()
    (tmp_path / "dataset.parquet").mkdir()  # a Parquet dataset folder is read as one
    check_data_files(load_job(GRPO, ["run.data.train=[train.jsonl, dataset.parquet]"]).run)
    for files, where, why in [("[train.jsonl, gone.jsonl]", "run.data.train[1]", "'gone.jsonl' does not exist"),
                              ("rows.csv", "run.data.train", "is not a .parquet or .jsonl file"),
                              ("folder.jsonl", "run.data.train", "is not a regular file")]:
        with pytest.raises(SpecError) as err:
            check_data_files(load_job(GRPO, [f"run.data.train={files}"]).run)
        assert err.value.path == where and why in err.value.message
    with pytest.raises(SpecError, match=r"^run\.data\.val: 'v\.parquet' does not exist"):
        check_data_files(load_job(GRPO, ["data.train_files=train.jsonl", "data.val_files=v.parquet"]).run)
