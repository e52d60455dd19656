"""``run.logger`` (verl's trainer.logger): the console, JSONL and TensorBoard sinks for real; wandb and
mlflow through stand-in modules (they are optional extras, not installed here), and the error that names
the key and the fix when one is requested but missing."""

from __future__ import annotations

import io
import json
import sys
import types

import pytest

from nereus.run.metrics import MetricsLog, Progress, check_loggers
from nereus.spec.errors import SpecError

STEP = {"critic/score/mean": 0.5, "actor/pg_loss": -0.25, "timing_s/step": 1.5}


def _events(folder) -> dict[str, list[tuple[int, float]]]:
    """Scalars read back from TensorBoard event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_default_sinks_console_jsonl_and_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    out = io.StringIO()
    log = MetricsLog(tmp_path / "metrics.jsonl", resume=False, stream=out)
    log.log(1, STEP)
    log.log(2, {**STEP, "actor/pg_loss": 0.75})
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and lines[1]["actor/pg_loss"] == 0.75
    assert "step 2: critic/score/mean=0.5  actor/pg_loss=0.75" in out.getvalue()
    assert _events(tmp_path / "tensorboard")["actor/pg_loss"] == [(1, -0.25), (2, 0.75)]


def test_explicit_list_is_exactly_those_sinks(tmp_path):
    out = io.StringIO()
    log = MetricsLog(tmp_path / "metrics.jsonl", resume=False, stream=out, loggers=("file",))
    log.log(1, STEP)
    log.close()
    assert out.getvalue() == ""  # no console
    assert not (tmp_path / "tensorboard").exists()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["timing_s/step"] == 1.5  # JSONL always


@pytest.mark.parametrize("name", ["wandb", "mlflow", "tensorboard"])
def test_requested_but_missing_package_names_the_key_and_the_fix(monkeypatch, tmp_path, name):
    module = "torch.utils.tensorboard" if name == "tensorboard" else name
    monkeypatch.setitem(sys.modules, module, None)  # import fails as when the package is absent
    with pytest.raises(SpecError, match=rf"run\.logger: '{name}' needs the {name} package.*"
                                        rf"pip install 'nereus\[{name}\]'"):
        check_loggers(("console", name))
    with pytest.raises(SpecError, match=r"run\.logger"):
        MetricsLog(tmp_path / "m.jsonl", resume=False, loggers=(name,))


def test_default_tensorboard_is_optional(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    log = MetricsLog(tmp_path / "m.jsonl", resume=False, quiet=True)
    log.log(1, STEP)
    log.close()
    assert log.sinks == [] and (tmp_path / "m.jsonl").exists()


def _recorder(name: str, calls: list) -> types.ModuleType:
    """A stand-in module recording the calls the sink makes (wandb/mlflow are not installed here)."""
    mod = types.ModuleType(name)

    def record(fn):
        def call(*args, **kwargs):
            calls.append((fn, args, kwargs))
            return types.SimpleNamespace(finish=lambda: calls.append(("finish", (), {})))
        return call

    for fn in ("init", "log", "start_run", "log_params", "log_metrics", "end_run"):
        setattr(mod, fn, record(fn))
    return mod


def test_wandb_call_path(monkeypatch, tmp_path):
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", _recorder("wandb", calls))
    log = MetricsLog(tmp_path / "m.jsonl", resume=False, quiet=True, loggers=("wandb",), name="job-x")
    log.log(3, {**STEP, "note": "text is not a metric"})
    log.close()
    assert [c[0] for c in calls] == ["init", "log", "finish"]
    assert calls[0][2]["project"] == "nereus" and calls[0][2]["name"] == "job-x"
    assert calls[1][1] == (STEP,) and calls[1][2] == {"step": 3}


def test_mlflow_call_path(monkeypatch, tmp_path):
    calls: list = []
    monkeypatch.setitem(sys.modules, "mlflow", _recorder("mlflow", calls))
    log = MetricsLog(tmp_path / "m.jsonl", resume=False, quiet=True, loggers=("mlflow",), name="job-y")
    log.log(4, STEP)
    log.close()
    assert [c[0] for c in calls] == ["start_run", "log_metrics", "end_run"]
    assert calls[0][2] == {"run_name": "job-y"} and calls[1][1] == (STEP,) and calls[1][2] == {"step": 4}


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _screen(text: str) -> list[str]:
    """The lines a terminal shows for ``text``: "\\r" returns to column 0, ESC [2K blanks the line, other
    characters overwrite the line from the cursor on."""
    shown = []
    for raw in text.split("\n"):
        line, col = [], 0
        for part in raw.split("\r"):
            col = 0
            while part.startswith("\x1b[2K"):
                line, part = [], part[4:]
            for ch in part:
                line[col:col + 1] = [ch]
                col += 1
        shown.append("".join(line))
    return shown


def test_a_metric_line_takes_over_the_progress_bars_line_on_a_terminal(tmp_path):
    term = _Terminal()
    bar = Progress(2, stream=term)
    log = MetricsLog(tmp_path / "metrics.jsonl", resume=False, stream=term, loggers=("console",))
    for step in (1, 2):
        log.log(step, {"actor/pg_loss": 0.5})  # far shorter than the bar it is written over
        bar.update(step)
    log.close()
    screen = _screen(term.getvalue())
    assert screen[:2] == ["step 1: actor/pg_loss=0.5", "step 2: actor/pg_loss=0.5"]
    assert screen[2].startswith("[" + "#" * 30 + "] 2/2 steps") and screen[3:] == [""]  # ended at the last step


def test_a_log_file_or_pipe_gets_plain_metric_lines_and_no_bar(tmp_path):
    out = io.StringIO()
    bar = Progress(2, stream=out)
    log = MetricsLog(tmp_path / "metrics.jsonl", resume=False, stream=out, loggers=("console",))
    for step in (1, 2):
        bar.update(step)
        log.log(step, {"actor/pg_loss": 0.5})
    log.close()
    assert out.getvalue() == "step 1: actor/pg_loss=0.5\nstep 2: actor/pg_loss=0.5\n"


TIMED = {"actor/pg_loss": 0.5, "timing_s/step": 2.0, "timing_s/gen": 1.25, "timing_s/old_log_prob": 0.125,
         "timing_s/ref": 0.0625, "timing_s/values": 0.0625, "timing_s/adv": 0.001, "timing_s/update_critic": 0.25,
         "timing_s/update_actor": 0.25, "timing_s/update_weights": 0.03125, "timing_s/worker_0/idle": 0.5}


def test_the_console_line_shows_each_stages_seconds_and_the_time_left():
    from nereus.run.metrics import clock_time, console_line, eta_seconds

    assert console_line(3, TIMED, eta_seconds({1: 2.0, 2: 4.0, 3: 3.0}, 3, 1203)) == (
        "step 3: actor/pg_loss=0.5  timing_s/step=2  timing_s: gen=1.25 old_log_prob=0.125 ref=0.0625 "
        "values=0.0625 adv=0.001 update_critic=0.25 update_actor=0.25 update_weights=0.0312  eta=1:00:00")
    assert console_line(1, {"actor/pg_loss": 0.5}) == "step 1: actor/pg_loss=0.5"  # nothing timed, no total
    assert eta_seconds({}, 1, 10) is None and eta_seconds({1: 2.0}, 1, None) is None
    assert eta_seconds({1: 2.0}, 12, 10) == 0 and clock_time(59.6) == "0:01:00"


def test_a_redirected_console_gets_the_stage_times_and_eta_and_a_rewind_forgets_redone_steps(tmp_path):
    out = io.StringIO()  # not a terminal: a log file or pipe
    log = MetricsLog(tmp_path / "metrics.jsonl", resume=False, stream=out, loggers=("console",), total=4)
    log.log(1, {**TIMED, "timing_s/step": 1.0})
    log.log(2, {**TIMED, "timing_s/step": 3.0})
    log.rewind(1)  # step 2 is redone after a recovery: its time leaves the mean
    log.log(2, {**TIMED, "timing_s/step": 5.0})
    log.close()
    lines = out.getvalue().splitlines()
    assert [line.split("  eta=")[1] for line in lines] == ["0:00:03", "0:00:04", "0:00:06"]
    assert all(" gen=1.25 " in line and "\x1b" not in line for line in lines)
