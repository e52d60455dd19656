"""Per-step metrics to the sinks of ``run.logger`` (verl's ``trainer.logger``): the console, a JSONL file
(always written: recovery rewinds it), TensorBoard, Weights & Biases and MLflow; plus a progress bar.
wandb and mlflow are optional extras (``pip install 'nereus[wandb]'`` / ``'nereus[mlflow]'``)."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, TextIO

from nereus.spec.errors import SpecError, brief
from nereus.spec.files import MAX_RECORD_BYTES, read_text_file

# What the console line shows per step (the JSONL file has every metric).
CONSOLE = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/kl_loss", "actor/reward_kl_penalty",
           "actor/entropy", "val/accuracy", "timing_s/step", "perf/throughput")
# The step's stages on the console line after them, in the order a step runs them: verl's ``timing_s/<name>``,
# shown as ``<name>=<seconds>`` (a stage the step did not time is left out).
CONSOLE_STAGES = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor",
                  "update_weights")

# Without ``run.logger``: the console, the JSONL file, and TensorBoard when it is installed.
DEFAULT = ("console", "jsonl", "tensorboard?")

# logger -> (module it needs, pip extra that installs it)
PACKAGES: Mapping[str, tuple[str, str]] = MappingProxyType({
    "tensorboard": ("torch.utils.tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow")})


# After "\r", ECMA-48's "erase in line" (CSI 2 K) blanks the whole line: a metric line written over the
# progress bar keeps none of the bar's characters. Only on a terminal; a file or a pipe gets plain lines.
ERASE_LINE = "\r\x1b[2K"


def is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal (False for a file, a pipe, a StringIO or a closed stream)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def console_line(step: int, metrics: Mapping[str, object], eta_s: float | None = None) -> str:
    """The console's line for a step: the ``CONSOLE`` metrics, the seconds of each stage (``CONSOLE_STAGES``)
    and, when given, the run's estimated time left (``eta_seconds``). The same on a terminal and redirected."""
    shown = [f"{k.split('/', 1)[-1] if k.startswith('val') else k}={metrics[k]:.4g}"
             for k in CONSOLE if _number(metrics.get(k))]
    stages = [f"{name}={metrics[f'timing_s/{name}']:.3g}" for name in CONSOLE_STAGES
              if _number(metrics.get(f"timing_s/{name}"))]
    if stages:
        shown.append("timing_s: " + " ".join(stages))
    if eta_s is not None:
        shown.append(f"eta={clock_time(eta_s)}")
    return f"step {step}: " + "  ".join(shown)


def eta_seconds(step_seconds: Mapping[int, float], done: int, total: int | None) -> float | None:
    """The run's time left after ``done`` of ``total`` steps: the mean ``timing_s/step`` of the steps logged
    so far (step → seconds) times the steps still to run (evaluations and checkpoint writes are not in it);
    None without a total or a step time."""
    if total is None or not step_seconds:
        return None
    return max(0, total - done) * sum(step_seconds.values()) / len(step_seconds)


def clock_time(seconds: float) -> str:
    """``seconds`` as h:mm:ss (rounded to the second)."""
    s = max(0, round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class MetricsDamaged(ValueError):
    """A line of ``metrics.jsonl`` that is not a metrics record (other than a last line torn by a kill)."""


def _step_of(line: str) -> int | None:
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def resume_lines(text: str, step: int) -> tuple[list[str], str | None]:
    """(the lines a run resumed after ``step`` steps keeps, the torn last line or None). Lines of later
    steps are dropped: those steps are redone and logged again. A last line without its newline that does
    not parse was torn by a driver killed while writing it; it is returned apart, for the caller to keep
    aside. Any other line that is not a JSON object with a ``step`` raises ``MetricsDamaged``: history is
    never cut silently."""
    lines = text.splitlines()
    torn = None
    if lines and not text.endswith("\n") and _step_of(lines[-1]) is None:
        torn = lines.pop()
    keep = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        at = _step_of(line)
        if at is None:
            raise MetricsDamaged(f"line {number} is not a metrics record ({brief(line)})")
        if at <= step:
            keep.append(line)
    return keep, torn


def rewound(text: str, step: int) -> list[str]:
    """The lines of ``text`` kept when a recovery redoes the steps after ``step``: every line but the
    records of later steps (a line that does not parse is kept: nothing is lost)."""
    return [line for line in text.splitlines() if line.strip() and ((at := _step_of(line)) is None or at <= step)]


def prepare_resume(path: Path, step: int, warn: TextIO = sys.stderr) -> list[str]:
    """The lines ``metrics.jsonl`` keeps when a run resumes after ``step`` steps, read with the strict
    reader (a directory, FIFO, binary or oversized file is refused by name) before any process starts. A
    damaged file is refused; a torn last line is dropped only after the whole file is kept aside, with a
    warning naming the copy."""
    if not os.path.lexists(path):
        return []
    text = read_text_file(path, "metrics", MAX_RECORD_BYTES)
    try:
        keep, torn = resume_lines(text, step)
    except MetricsDamaged as err:
        raise SpecError("--resume", f"{path}: {err}; its step history would be lost: repair that line, or "
                                    f"move the file aside (mv {path} {path.name}.old) to resume with a new "
                                    "history") from None
    if torn is not None:
        aside = _free_name(path)
        shutil.copyfile(path, aside)
        print(f"nereus: warning: {path} ends in a line torn when its driver was killed ({brief(torn)}); kept the "
              f"file as {aside.name} and resumed without that line", file=warn, flush=True)
    return keep


def _free_name(path: Path) -> Path:
    for k in range(1, 10_000):
        candidate = path.with_name(f"{path.stem}.before-resume-{k}{path.suffix}")
        if not os.path.lexists(candidate):
            return candidate
    raise SpecError("--resume", f"{path.parent} holds 10,000 kept metrics files; remove old ones")


def _import(name: str, required: bool) -> Any:
    """The module a logger needs; None when it is optional and absent, an error naming the fix otherwise."""
    module, extra = PACKAGES[name]
    try:
        return importlib.import_module(module)
    except Exception:  # absent (ImportError) or broken: say how to install it
        if not required:
            return None
        raise SpecError("run.logger", f"{name!r} needs the {extra} package, which is not installed; "
                                      f"pip install 'nereus[{extra}]' (or remove {name!r})") from None


def check_loggers(loggers: tuple[str, ...] | None) -> None:
    """Fail before the run starts when a requested logger's package is missing."""
    for name in loggers or ():
        if name in PACKAGES:
            _import(name, required=True)


class _TensorBoard:
    def __init__(self, module: Any, folder: Path) -> None:
        self.writer = module.SummaryWriter(str(folder))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, module: Any, folder: Path, name: str, config: dict) -> None:
        self.wandb = module
        self.run = module.init(project="nereus", name=name, dir=str(folder), config=config)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.wandb.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    def __init__(self, module: Any, name: str, config: dict) -> None:
        self.mlflow = module
        module.start_run(run_name=name)
        if config:
            module.log_params(config)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.mlflow.log_metrics(metrics, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def _sinks(loggers: tuple[str, ...], folder: Path, name: str, config: dict) -> list:
    out: list = []
    for entry in loggers:
        logger, required = entry.rstrip("?"), not entry.endswith("?")
        if logger not in PACKAGES:
            continue
        module = _import(logger, required)
        if module is None:
            continue
        if logger == "tensorboard":
            out.append(_TensorBoard(module, folder / "tensorboard"))
        elif logger == "wandb":
            out.append(_Wandb(module, folder, name, config))
        else:
            out.append(_MLflow(module, name, config))
    return out


class MetricsLog:
    """Appends one JSON object per step to ``path`` and hands each step's numbers to the other sinks of
    ``loggers`` (verl's names: console, jsonl/file, tensorboard, wandb, mlflow; None: ``DEFAULT``). ``total``:
    the run's steps, for the console line's time left."""

    def __init__(self, path: Path, resume: bool, stream: TextIO = sys.stderr, quiet: bool = False,
                 loggers: tuple[str, ...] | None = None, name: str = "nereus", config: dict | None = None,
                 total: int | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        loggers = DEFAULT if loggers is None else loggers
        self.path, self.stream, self.total = path, stream, total
        self.step_seconds: dict[int, float] = {}  # timing_s/step of each step logged by this process
        self.quiet = quiet or "console" not in loggers
        self.sinks = _sinks(loggers, path.parent, name, config or {})
        self.file = path.open("a" if resume else "w")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        for sink in self.sinks:
            sink.log(step, numbers)
        if _number(metrics.get("timing_s/step")):
            self.step_seconds[step] = float(metrics["timing_s/step"])
        if not self.quiet:
            lead = ERASE_LINE if is_terminal(self.stream) else ""  # the bar's line, taken over
            eta = eta_seconds(self.step_seconds, step, self.total)
            self.stream.write(f"{lead}{console_line(step, metrics, eta)}\n")
            self.stream.flush()  # a log file or pipe sees each step as it ends

    def rewind(self, step: int) -> None:
        """Drop the JSONL lines after ``step`` steps (they are about to be redone; the other sinks get the
        redone steps again)."""
        self.file.flush()
        self.step_seconds = {s: t for s, t in self.step_seconds.items() if s <= step}
        lines = rewound(self.path.read_text(errors="replace"), step)
        self.file.close()
        self.path.write_text("".join(ln + "\n" for ln in lines))
        self.file = self.path.open("a")

    def close(self) -> None:
        self.file.close()
        for sink in self.sinks:
            sink.close()


class Progress:
    """A one-line progress bar on ``stream`` (steps done, rate, time left), redrawn in place; drawn only on a
    terminal (a log file or pipe gets the per-step metric lines alone) and ended by a newline at ``total``."""

    def __init__(self, total: int, start: int = 0, stream: TextIO = sys.stderr, quiet: bool = False) -> None:
        self.total, self.start, self.done = total, start, start
        self.t0, self.stream, self.quiet = time.perf_counter(), stream, quiet or not is_terminal(stream)

    def update(self, done: int) -> None:
        self.done = done
        if self.quiet:
            return
        width = 30
        filled = int(width * done / max(1, self.total))
        elapsed = time.perf_counter() - self.t0
        rate = (done - self.start) / elapsed if elapsed > 0 else 0.0
        left = (self.total - done) / rate if rate > 0 else float("nan")
        self.stream.write(f"{ERASE_LINE}[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} steps  "
                          f"{elapsed:6.0f}s elapsed  ~{left:5.0f}s left" + ("\n" if done >= self.total else ""))
        self.stream.flush()
