"""The exact event simulation of one replica's continuously batched generation (``generation_time``): the
reference ``cost.decode.decode_phases`` stands for in closed form, and the published decode rows' check."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from nereus.cost.decode import Replica, prefill_time, step_time


@dataclass(frozen=True)
class Generation:
    """A continuously batched generation: seconds in the bulk phase (every slot busy, refilled from the
    queue), in the tail (fewer sequences left than slots: the batch drains), in prefill, and the decode
    steps that were memory- vs compute-bound."""

    bulk_s: float
    tail_s: float
    prefill_s: float
    steps: dict[str, int]
    tokens: int

    @property
    def total_s(self) -> float:
        return self.bulk_s + self.tail_s + self.prefill_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_s


def generation_time(r: Replica, prompt: int, lengths: list[int], batch: int) -> Generation:
    """Generate ``lengths`` (response tokens, in arrival order) after ``prompt``-token prompts with at
    most ``batch`` sequences in flight: a sequence that ends frees its slot for the next one in the queue
    (iteration-level scheduling), whose prefill runs before the next step. The first response token
    comes from prefill, each further one from a decode step. Step time is evaluated once per stretch of
    steps between two completions, at the stretch's mean context."""
    queue = list(reversed(lengths))
    active: list[tuple[int, int]] = []  # heap of (step it ends at, step it started at)
    starts_sum, step = 0.0, 0
    times = {"bulk": 0.0, "tail": 0.0, "prefill": 0.0}
    bounds = {"memory": 0, "compute": 0}
    while queue or active:
        admitted = 0
        while queue and len(active) < batch:
            heapq.heappush(active, (step + max(0, queue.pop() - 1), step))
            starts_sum += step
            admitted += 1
        if admitted:
            times["prefill"] += prefill_time(r, admitted * prompt, prompt)
        end, n = active[0][0], len(active)
        if end > step:
            mid = step + (end - step - 1) / 2
            st = step_time(r, n, prompt + 1 + mid - starts_sum / n)
            times["bulk" if n >= batch else "tail"] += (end - step) * st.total
            bounds[st.bound] += end - step
            step = end
        while active and active[0][0] == step:
            starts_sum -= heapq.heappop(active)[1]
    return Generation(times["bulk"], times["tail"], times["prefill"], bounds, sum(lengths))
