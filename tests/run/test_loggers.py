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
