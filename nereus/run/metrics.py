"""Per-step metrics to the console, a JSONL file and (when installed) TensorBoard, plus a progress bar."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TextIO

# What the console line shows per step (the JSONL file has every metric).
CONSOLE = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/kl", "val/accuracy",
           "timing_s/step", "perf/throughput")


class MetricsLog:
    """Appends one JSON object per step to ``path``; mirrors to TensorBoard if ``torch.utils.tensorboard``
    imports (it needs the ``tensorboard`` package)."""

    def __init__(self, path: Path, resume: bool, stream: TextIO = sys.stderr, quiet: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.stream, self.quiet = path, stream, quiet
        self.file = path.open("a" if resume else "w")
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(path.parent / "tensorboard"))
        except Exception:  # tensorboard absent (ImportError) or broken: metrics still go to JSONL
            self.tb = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)
        if not self.quiet:
            shown = "  ".join(f"{k.split('/', 1)[-1] if k.startswith('val') else k}={metrics[k]:.4g}"
                              for k in CONSOLE if k in metrics)
            self.stream.write(f"\rstep {step}: {shown}\n")

    def rewind(self, step: int) -> None:
        """Drop the lines after ``step`` steps (they are about to be redone)."""
        self.file.flush()
        lines = [ln for ln in self.path.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
        self.file.close()
        self.path.write_text("".join(ln + "\n" for ln in lines))
        self.file = self.path.open("a")

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


class Progress:
    """A one-line progress bar on ``stream`` (steps done, rate, time left)."""

    def __init__(self, total: int, start: int = 0, stream: TextIO = sys.stderr, quiet: bool = False) -> None:
        self.total, self.start, self.done = total, start, start
        self.t0, self.stream, self.quiet = time.perf_counter(), stream, quiet

    def update(self, done: int) -> None:
        self.done = done
        if self.quiet:
            return
        width = 30
        filled = int(width * done / max(1, self.total))
        elapsed = time.perf_counter() - self.t0
        rate = (done - self.start) / elapsed if elapsed > 0 else 0.0
        left = (self.total - done) / rate if rate > 0 else float("nan")
        self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} steps  "
                          f"{elapsed:6.0f}s elapsed  ~{left:5.0f}s left")
        self.stream.flush()
