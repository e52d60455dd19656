"""The micro-batches an inference or training stage runs on one data-parallel replica, priced as the runtime
forms them from the same plan fields (``Layout.max_token_len``, ``micro_batch_size``, ``dp``):

- **packed** (``max_token_len`` > 0; verl's use_remove_padding + use_dynamic_bsz): every row at its own
  length, dealt to the replicas by tokens and grouped into micro-batches of at most the budget, by the
  runtime's own plan (``spec.packing.replica_shares``, ``token_budget_groups``), on the expected lengths:
  prompt + the response distribution's mid-quantiles, one per row;
- **padded** (``max_token_len`` 0 on a runtime that pads, ``Options.padded_batches``: the Nereus runtime):
  ``micro_batch_size`` rows each as wide as the step's longest row (prompt + the expected longest of the
  step's responses), as the rollout pads them;
- **rows unpadded** (``max_token_len`` 0 elsewhere: verl's use_remove_padding without dynamic batches):
  ``micro_batch_size`` rows of the mean length.

A stage's GEMMs run on ``tokens`` per micro-batch and its attention on ``context`` per token (Σ len² / Σ len:
causal attention within each row costs its length squared), so ``seq`` × ``mbs`` below is ``tokens`` and
the layer formulas of ``cost.stages`` and ``cost.memory`` apply unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nereus.spec.job import JobSpec
from nereus.spec.layout import Layout
from nereus.spec.packing import replica_shares, token_budget_groups


@dataclass(frozen=True)
class MicroBatches:
    """The fullest replica's micro-batches of one stage: ``count`` of them, ``rows`` rows and ``tokens``
    tokens each on average, attention ``context`` per token, and the mode (``packed``, ``padded``, ``rows``)."""

    count: int
    rows: float
    tokens: float
    context: float
    mode: str

    @property
    def seq(self) -> float:
        """The sequence length the layer formulas take (the attention context)."""
        return self.context

    @property
    def mbs(self) -> float:
        """The micro-batch size the layer formulas take: ``seq`` × ``mbs`` = ``tokens``."""
        return self.tokens / self.context


def row_lengths(job: JobSpec, rows: int) -> list[int]:
    """Expected tokens of ``rows`` rows: a training-only job's fixed length, else prompt + the response
    length distribution's ``rows`` mid-quantiles (what ``cost.stages`` prices generation with)."""
    wl = job.workload
    if job.algorithm.name == "train":
        return [wl.sequence_length] * rows
    return [max(1, round(wl.prompt_length + q)) for q in wl.response.quantiles(rows)]


def padded_width(job: JobSpec) -> int:
    """Tokens of every row of a padded step: prompt + the expected longest of the step's responses."""
    wl = job.workload
    if job.algorithm.name == "train":
        return wl.sequence_length
    return wl.prompt_length + math.ceil(wl.response.longest(job.sequences_per_step()))


def mean_length(job: JobSpec) -> int:
    """Tokens of a row at the mean length (rows unpadded), or a training-only job's fixed length."""
    wl = job.workload
    if job.algorithm.name == "train":
        return wl.sequence_length
    return int(round(wl.prompt_length + wl.response.mean))


def micro_batches(job: JobSpec, layout: Layout, rows: int) -> MicroBatches | None:
    """How a stage batch of ``rows`` rows runs under ``layout`` on its fullest replica; None when the batch
    does not split (fewer rows than replicas, or than a padded micro-batch)."""
    if rows < layout.dp:
        return None
    if layout.max_token_len > 0:
        return _packed(row_lengths(job, rows), layout)
    per_replica = math.ceil(rows / layout.dp)
    mbs = layout.micro_batch_size
    if per_replica < mbs:
        return None
    width, mode = (padded_width(job), "padded") if job.options.padded_batches else (mean_length(job), "rows")
    return MicroBatches(math.ceil(per_replica / mbs), mbs, float(mbs * width), float(width), mode)


def _packed(lengths: list[int], layout: Layout) -> MicroBatches:
    shares = replica_shares(lengths, layout.dp)
    mine = [lengths[i] for i in max(shares, key=lambda rows: sum(lengths[i] for i in rows))]
    count = len(token_budget_groups(mine, layout.max_token_len))
    total = sum(mine)
    return MicroBatches(count, len(mine) / count, total / count, sum(n * n for n in mine) / total, "packed")
