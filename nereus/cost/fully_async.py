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

Steady state of the pipeline, per parameter version of ``N`` samples taken in ``k`` local steps of ``N/k``
(``trigger_parameter_sync_step``), with ``G`` the rollouter's time to produce them, ``A`` the trainer's
assembly of them, ``B`` its other work on them (inference and training) and ``s`` the staleness threshold:

- the rollouter may start at most ``(1 + s)·N`` samples per version, counting those still queued or in
  flight when the version begins (``FullyAsyncRollouter``: ``max_required_samples`` and the reset of
  ``staleness_samples`` in ``update_param_version``), so when that quota binds, a version begins with
  ``s·N`` samples ahead and the trainer's local step ``i`` waits until ``(i/k − s)·N`` more are done: at
  ``(i/k − s)·G`` into the version, while the trainer's own work has reached ``(i − 1)·B/k``. The first
  step is short of samples when ``s < 1/k``, the last when ``(1 − s)·G > (k − 1)·B/k``; at staleness 0 the
  trainer still streams a version's first local steps while its last samples decode;
- when the rollouter cannot keep up even so (``G > A + B``), both sides stop for the parameter sync (the
  rollouter pauses for it, ``pause``/``resume`` around ``sync_weights``), so the trainer's cycle ``gen + B``
  is the rollouter's ``G``: ``gen = G − B``, which already holds the assembly.

So ``gen = max(A + shortfall, G − B)`` with ``shortfall = max(0, (1/k − s)·G, (1 − s)·G − (k − 1)·B/k)``
(linear in ``i``, so its largest term is the first step's or the last's), and ``step = gen + B``. Production
is taken as steady within a version; the threshold's other effect, absorbing the rollouter's
fluctuations, is not modelled.
"""

from __future__ import annotations

from nereus.cost.controller import controller_time


def queue_assembly_time(sequences: int, padded_tokens: int) -> float:
    """Seconds the trainer spends turning the samples it took from the queue into a batch: they arrive
    already padded to the caps (the rollouter's agent loop pads them) as pickled bytes from the queue actor,
    and the driver unpickles and concatenates them. That is one direction of a stage call's data path
    through the driver, so half of ``cost.controller.controller_time``."""
    return controller_time(sequences, padded_tokens) / 2


# verl's fully-async defaults (verl/experimental/fully_async_policy/config/fully_async_ppo_trainer.yaml and
# its Megatron twin, ``async_training``): a parameter sync every 4 local steps, staleness threshold 0.1. The
# recipes behind verl's fully-async tables set 4 local steps too (docs/advance/fully_async.md).
LOCAL_STEPS_PER_VERSION = 4
STALENESS_THRESHOLD = 0.1


def sample_shortfall(production_s: float, other_work_s: float, staleness: float,
                     local_steps: int = LOCAL_STEPS_PER_VERSION) -> float:
    """Seconds a trainer fed within the staleness quota waits for a version's samples beyond their assembly:
    the most any local step ``i`` waits for its ``(i/k − s)`` share of the version's production while the
    trainer's work has reached ``(i − 1)/k`` of its own (module docstring)."""
    k, s = local_steps, staleness
    first = (1 / k - s) * production_s
    last = (1 - s) * production_s - (k - 1) / k * other_work_s
    return max(0.0, first, last)


def trainer_wait(production_s: float, assembly_s: float, other_work_s: float, staleness: float,
                 local_steps: int = LOCAL_STEPS_PER_VERSION) -> float:
    """Seconds verl's fully-async trainer's ``gen`` timer holds per parameter version: the assembly of the
    samples plus what the staleness quota keeps them short by, or, when the rollouter is the bottleneck,
    the part of its production time the trainer's own work does not cover."""
    shortfall = sample_shortfall(production_s, other_work_s, staleness, local_steps)
    return max(assembly_s + shortfall, production_s - other_work_s)


def trainer_step(production_s: float, assembly_s: float, other_work_s: float, staleness: float,
                 local_steps: int = LOCAL_STEPS_PER_VERSION) -> float:
    """Seconds of the trainer's ``step`` timer per parameter version: its wait plus its own work."""
    return trainer_wait(production_s, assembly_s, other_work_s, staleness, local_steps) + other_work_s
