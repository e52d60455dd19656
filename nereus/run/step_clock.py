"""The RL step's timings under verl's names (``timing_s/gen``, ``timing_s/update_actor``, ...).

The names are metric names of an open-ended map (each inference stage and each trained model adds its
own), so they stay strings; one ``StepClock`` is shared by the step's pieces and reset at each step's start.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class StepClock:
    """``timing``: ``timing_s/<name>`` → seconds of the step so far."""

    def __init__(self) -> None:
        self.timing: dict[str, float] = {}

    def reset(self) -> None:
        self.timing = {}

    @contextmanager
    def timer(self, name: str) -> Iterator[None]:
        """Add the wall time of the block to ``timing_s/<name>``."""
        t0 = time.perf_counter()
        yield
        self.timing[f"timing_s/{name}"] = self.timing.get(f"timing_s/{name}", 0.0) + time.perf_counter() - t0

    def add(self, name: str, seconds: float) -> None:
        """Add ``seconds`` measured elsewhere (a worker call's own duration) to ``timing_s/<name>``."""
        self.timing[f"timing_s/{name}"] = self.timing.get(f"timing_s/{name}", 0.0) + seconds

    def set(self, name: str, seconds: float) -> None:
        self.timing[f"timing_s/{name}"] = seconds

    def seconds(self, name: str) -> float:
        """``timing_s/<name>`` so far (0 when the step has not timed it)."""
        return self.timing.get(f"timing_s/{name}", 0.0)
