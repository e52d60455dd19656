"""``nereus run JOB overrides``: the header prints the algorithm as it runs and the run's folder gets
``effective_config.yaml`` (the job tree, overrides applied) beside metrics.jsonl. The runtime side is a stand-in:
nothing starts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import yaml

from nereus.cli import main
from nereus.run import cli as run_cli
from nereus.runtime.hosts import raylocal

PPO = Path(__file__).resolve().parents[2] / "examples" / "ppo_tiny.yaml"


class _Accepted:
    """What ``run.cli._accept`` hands back, without models, data or workers."""

    def __init__(self, job, out: Path, workers: int) -> None:
        job = replace(job, run=replace(job.run, workers=workers))  # as RLJob applies --workers
        self.job, self.run, self.dir, self.placed = job, job.run, out, []

    def execute(self, resume: bool) -> dict:
        return {}

    def release(self) -> None:
        pass


def test_the_header_prints_and_the_folder_keeps_the_effective_config(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run_cli, "_accept", lambda args, job: _Accepted(job, args.out, args.workers))
    monkeypatch.setattr(raylocal, "exit_on_signals", lambda: (lambda: None))
    out = tmp_path / "out"
    assert main(["run", str(PPO), "algorithm.adv_estimator=grpo", "--out", str(out), "--workers", "3"]) == 0
    err = capsys.readouterr().err
    assert "nereus run: ppo-tiny (grpo, 150 steps)" in err
    assert (f"  algorithm.name=grpo adv_estimator=grpo samples_per_prompt=4 mini_batches=2 epochs=1 "
            f"models=[actor, reference, reward]; config {out / 'effective_config.yaml'}") in err
    saved = yaml.safe_load((out / "effective_config.yaml").read_text())
    assert saved["algorithm"]["name"] == "grpo" and saved["run"]["workers"] == 3  # --workers is in it too
