"""`nereus run` refuses bad input before starting workers: errors name the file, row and field, or the
job spec's key path."""

from __future__ import annotations

import json

import yaml

from nereus.cli import main
from tests.conftest import EXAMPLES


def _job(tmp_path, **run) -> str:
    spec = yaml.safe_load((EXAMPLES / "ppo_tiny_fixed.yaml").read_text())
    spec["run"].update(run)
    spec["cluster"]["profile"] = str(EXAMPLES / spec["cluster"]["profile"])  # relative to the example
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def test_malformed_data_file_names_file_row_and_field(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    good = {"prompt": [{"role": "user", "content": "rev:12="}], "reward_model": {"ground_truth": "21"}}
    data.write_text(json.dumps(good) + "\n" + json.dumps({**good, "reward_model": {}}) + "\n")
    assert main(["run", _job(tmp_path, data={"train": str(data)}), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"{data}: row 1: field 'reward_model.ground_truth'" in err


def test_too_long_prompt(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    row = {"prompt": [{"role": "user", "content": "rev:" + "3" * 20 + "="}], "reward_model": {"ground_truth": "1"}}
    data.write_text(json.dumps(row) + "\n")
    assert main(["run", _job(tmp_path, data={"train": str(data)}), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"{data}: row 0: field 'prompt': 26 tokens exceed the maximum prompt length 16" in err


def test_batch_that_does_not_split_names_the_layout(tmp_path, capsys):
    job = _job(tmp_path, layouts={"actor/training": {"layout": "dp=3", "ranks": [0, 1, 2]}})
    assert main(["run", job, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "run.layouts.actor/training: the mini-batch of 64 sequences does not split into dp=3" in err


def test_job_without_run_section(capsys):
    assert main(["run", str(EXAMPLES / "ppo_8b_h100.yaml")]) == 2
    assert "has no `run:` section" in capsys.readouterr().err


def test_fewer_workers_than_the_layouts_use(tmp_path, capsys):
    assert main(["run", _job(tmp_path), "--workers", "2", "--out", str(tmp_path / "o")]) == 2
    assert "uses worker 3 but the run has 2 workers" in capsys.readouterr().err


def test_train_file_without_val_holds_out_its_last_rows(tmp_path):
    from nereus.rl.data import CharTokenizer, write_rows
    from nereus.rl.task import reverse_rows
    from nereus.run.setup import datasets
    from nereus.spec.job import load_job

    data = write_rows(tmp_path / "train.parquet", reverse_rows(50, seed=0, max_digits=4))
    job = load_job(_job(tmp_path, data={"train": str(data), "val_size": 20}))
    train, val = datasets(job, CharTokenizer(), tmp_path)
    assert len(train) == 45 and len(val) == 5  # at most a tenth is held out
    assert not {p.ids for p in train} & {p.ids for p in val}
