"""Running the CLI in-process (``nereus.cli.main``) with captured output, the small files the CLI tests
feed it, and the promise every bad input must keep (docs/reliability.md, "One-line errors")."""

from __future__ import annotations

import contextlib
import copy
import io
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from nereus.cli import main
from tests.conftest import EXAMPLES, ROOT

TRACE = ROOT / "traces" / "growth_from_16.yaml"
PLAN_64 = EXAMPLES / "plans" / "ppo_8b_h100_64.json"
PLAN_128 = EXAMPLES / "plans" / "ppo_8b_h100_128.json"
JOB_8B = EXAMPLES / "ppo_8b_h100.yaml"  # the job the two plans above were made for
JOB_TRAIN = EXAMPLES / "train_gpt_1t_a100.yaml"
PROFILE = EXAMPLES / "cpu-local.yaml"


@dataclass
class Result:
    code: int
    out: str
    err: str


def run_cli(*argv: object, stdout: object | None = None) -> Result:
    """``nereus ARGV`` in this process; stdout and stderr captured (``stdout`` replaces the capture)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout or out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return Result(code, out.getvalue(), err.getvalue())


def refusal_problem(r: Result, *needles: str, preamble: bool = False) -> str | None:
    """What breaks the promise for bad input, or None: exit code 2, no traceback, and stderr one line
    (``preamble``: `nereus run` reports its set-up first, so the error is the one and last error line)."""
    lines = r.err.splitlines()
    if r.code != 2:
        return f"exit code {r.code}, not 2; stderr: {r.err[-500:]!r}"
    if "Traceback" in r.err:
        return f"a traceback on stderr: {r.err[-500:]!r}"
    errors = [ln for ln in lines if ln.startswith("nereus") and "error:" in ln]
    if not r.err.endswith("\n") or len(errors) != 1 or lines[-1] != errors[0]:
        return f"not one error line at the end: {r.err[-500:]!r}"
    if not preamble and len(lines) != 1:
        return f"{len(lines)} lines on stderr, not 1: {r.err[-500:]!r}"
    missing = [n for n in needles if n not in errors[0]]
    if missing:
        return f"the error does not mention {missing}: {errors[0]!r}"
    return None


def assert_refused(r: Result, *needles: str, preamble: bool = False) -> None:
    problem = refusal_problem(r, *needles, preamble=preamble)
    assert problem is None, problem


def tiny_job_doc(out_dir: str | Path = "runs/cli-test") -> dict:
    """A GRPO job with a `run:` section small enough that `nereus run` sets up in milliseconds (the
    workers start only after the checks this suite exercises)."""
    doc = yaml.safe_load((EXAMPLES / "grpo_tiny.yaml").read_text())
    doc["run"]["data"] = {"train_size": 40, "val_size": 6, "max_digits": 3}
    doc["run"]["checkpoint"] = {"dir": str(out_dir), "every": 1}
    doc["run"]["steps"] = 2
    return doc


def write_yaml(path: Path, doc: object) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def write_json(path: Path, doc: object) -> Path:
    path.write_text(json.dumps(doc))
    return path


def run_record() -> dict:
    """A run record as `nereus simulate --out` writes it (two steps), built without simulating."""
    step = {"step": 0, "step_time_s": 10.0, "phases": {"generation": 6.0, "training": 4.0}, "gpus": 8,
            "response_mean": 100.0, "response_max": 400.0, "tokens": 1000.0, "transition_s": 0.0,
            "lost_s": 0.0, "strategy": None}
    steps = [step, {**copy.deepcopy(step), "step": 1, "transition_s": 2.0, "strategy": "live"}]
    summary = {"policy": "nereus", "steps": 2, "mean_step_s": 10.0, "run_s": 22.0, "transitions": 1,
               "transition_s": 2.0, "transition_share": 0.09, "tokens_per_s": 90.0, "tokens_per_gpu_s": 11.0,
               "failures": 0, "lost_s": 0.0, "controller_overhead_s_per_step": 0.0,
               "controller_overhead_share": 0.0, "wall_s": 0.1}
    return {"policy": "nereus", "job": "j", "trace": "t", "seed": 0, "summary": summary, "steps": steps,
            "decisions": [], "plans": []}
