"""Per-step metrics to the sinks of ``run.logger`` (verl's ``trainer.logger``): the console, a JSONL file
(always written: recovery rewinds it), TensorBoard, Weights & Biases and MLflow; plus a progress bar.
wandb and mlflow are optional extras (``pip install 'nereus[wandb]'`` / ``'nereus[mlflow]'``)."""

from __future__ import annotations

import importlib
import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, TextIO

from nereus.spec.errors import SpecError

# What the console line shows per step (the JSONL file has every metric).
CONSOLE = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/kl_loss", "actor/reward_kl_penalty",
           "actor/entropy", "val/accuracy", "timing_s/step", "perf/throughput")

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


def lines_through(text: str, step: int) -> list[str]:
    """The metric lines of ``text`` for steps up to ``step``. A line that does not parse (torn when a driver
    was killed while writing it) or names no step is dropped: resuming redoes those steps anyway."""
    keep = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            keep.append(line)
    return keep


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
    ``loggers`` (verl's names: console, jsonl/file, tensorboard, wandb, mlflow; None: ``DEFAULT``)."""

    def __init__(self, path: Path, resume: bool, stream: TextIO = sys.stderr, quiet: bool = False,
                 loggers: tuple[str, ...] | None = None, name: str = "nereus", config: dict | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        loggers = DEFAULT if loggers is None else loggers
        self.path, self.stream = path, stream
        self.quiet = quiet or "console" not in loggers
        self.sinks = _sinks(loggers, path.parent, name, config or {})
        self.file = path.open("a" if resume else "w")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        for sink in self.sinks:
            sink.log(step, numbers)
        if not self.quiet:
            shown = "  ".join(f"{k.split('/', 1)[-1] if k.startswith('val') else k}={metrics[k]:.4g}"
                              for k in CONSOLE if k in metrics)
            lead = ERASE_LINE if is_terminal(self.stream) else ""  # the bar's line, taken over
            self.stream.write(f"{lead}step {step}: {shown}\n")

    def rewind(self, step: int) -> None:
        """Drop the JSONL lines after ``step`` steps (they are about to be redone; the other sinks get the
        redone steps again)."""
        self.file.flush()
        lines = lines_through(self.path.read_text(errors="replace"), step)
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
