"""What verl's fully-asynchronous trainer waits for: a producer/consumer pipeline priced in steady state.

In verl's fully-async mode a rollouter on its own GPUs streams finished samples into a message queue and
the trainer takes them out (volcengine/verl, verl/experimental/fully_async_policy: ``FullyAsyncRollouter``,
``MessageQueue``, ``FullyAsyncTrainer.fit``). Per local step the trainer's ``gen`` timer wraps
``_get_samples_from_queue``: the wait until ``require_batches × ppo_mini_batch_size`` samples are in the
queue, then unpickling and concatenating them into one batch (``assemble_batch_from_rollout_samples``);
the ``step`` timer wraps ``gen`` and the batch's processing (log-probs, update). After
``trigger_parameter_sync_step`` local steps the trainer syncs weights outside the ``step`` timer, and the
published per-step figures are the sums of the local steps' timers (``MetricsAggregator``: ``timing_s/*``
aggregate as ``time_sum``), i.e. one published step is one parameter version's samples.

Steady state of the pipeline, per parameter version of ``N`` samples, with ``G`` the rollouter's time to
produce them, ``A`` the trainer's assembly of them and ``B`` its other work on them (inference and
training):

- trainer-bound (``G ≤ A + B``): samples are waiting when the trainer asks; ``gen`` is the assembly alone;
  the rollouter runs ahead until ``staleness_threshold`` blocks it (at most ``(1 + s)·N`` samples per
  version), which bounds the queue but does not change the wait;
- rollout-bound (``G > A + B``): both sides stop for the parameter sync (the rollouter pauses for it,
  ``pause``/``resume`` around ``sync_weights``), so the trainer's cycle ``gen + B`` equals the rollouter's
  ``G``: ``gen = G − B``, which already holds the assembly.

So ``gen = max(A, G − B)`` and ``step = gen + B = max(A + B, G)``. The staleness threshold's other effect,
absorbing the rollouter's fluctuations, is not modelled: a steady rate has none.
"""

from __future__ import annotations

from nereus.cost.controller import controller_time


def queue_assembly_time(sequences: int, padded_tokens: int) -> float:
    """Seconds the trainer spends turning the samples it took from the queue into a batch: they arrive
    already padded to the caps (the rollouter's agent loop pads them) as pickled bytes from the queue actor,
    and the driver unpickles and concatenates them. That is one direction of a stage call's data path
    through the driver, so half of ``cost.controller.controller_time``."""
    return controller_time(sequences, padded_tokens) / 2


def trainer_wait(production_s: float, assembly_s: float, other_work_s: float) -> float:
    """Seconds verl's fully-async trainer's ``gen`` timer holds per parameter version: the assembly of the
    samples when the trainer is the bottleneck, else the part of the rollouter's production time the
    trainer's own work does not cover."""
    return max(assembly_s, production_s - other_work_s)


def trainer_step(production_s: float, assembly_s: float, other_work_s: float) -> float:
    """Seconds of the trainer's ``step`` timer per parameter version: its wait plus its own work."""
    return trainer_wait(production_s, assembly_s, other_work_s) + other_work_s
