"""Bounded asynchrony: generation of step k + s overlapping training of step k on a split of the GPUs.

The generation pool (g GPUs) produces step k + s's samples while the training pool (n − g GPUs) trains
step k on samples generated s steps earlier; after each training step the new weights go to the
generation pool (verl's one-step-off: NCCL broadcast, "under 300 ms", docs/advance/one_step_off.md). In
steady state a step takes the slower pool's time plus the exposed weight sync,

    step = max(gen(g), train(n − g)) + sync,

against the colocated synchronous step gen(n) + train(n) (verl: "step ≈ gen + old_log_prob +
update_actor"). Staleness s ≥ 1 sets the policy lag of every trained token and how much step-to-step
variation the queue absorbs; the steady-state step does not depend on it. ``best_split`` prices every
split the caller has stage times for (the planner lays out both pools and passes their times).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class AsyncEstimate:
    gen_gpus: int
    train_gpus: int
    gen_s: float  # the generation pool's seconds per step's samples
    train_s: float  # the training pool's seconds per step (everything but generation)
    sync_s: float  # weight transfer from the training pool to the generation pool, per step
    staleness: int  # policy lag of every trained token

    @property
    def step_s(self) -> float:
        return max(self.gen_s, self.train_s) + self.sync_s

    @property
    def idle_gen_s(self) -> float:
        """Seconds a step the generation pool waits for the next weights."""
        return max(0.0, self.train_s - self.gen_s)

    @property
    def idle_train_s(self) -> float:
        """Seconds a step the training pool waits for samples (verl's ``wait_prev_gen``)."""
        return max(0.0, self.gen_s - self.train_s)


def async_step(gen_gpus: int, train_gpus: int, gen_s: float, train_s: float, sync_s: float,
               staleness: int = 1) -> AsyncEstimate:
    if staleness < 1:
        raise ValueError(f"staleness {staleness}: bounded asynchrony needs at least one step of lag")
    return AsyncEstimate(gen_gpus, train_gpus, gen_s, train_s, sync_s, staleness)


def best_split(gen_by_gpus: Mapping[int, float], train_by_gpus: Mapping[int, float], total_gpus: int,
               sync_s: float, staleness: int = 1) -> AsyncEstimate:
    """The split of ``total_gpus`` with the shortest asynchronous step, over the generation-pool sizes g
    with a generation time for g and a training time for total − g GPUs."""
    options = [async_step(g, total_gpus - g, gen_by_gpus[g], train_by_gpus[total_gpus - g], sync_s, staleness)
               for g in sorted(gen_by_gpus) if 0 < g < total_gpus and total_gpus - g in train_by_gpus]
    if not options:
        raise ValueError(f"no split of {total_gpus} GPUs has both a generation and a training time")
    return min(options, key=lambda e: e.step_s)


def speedup_over_colocated(estimate: AsyncEstimate, colocated_gen_s: float, colocated_train_s: float) -> float:
    """The synchronous colocated step (every GPU generates, then every GPU trains) over the async step."""
    return (colocated_gen_s + colocated_train_s) / estimate.step_s
