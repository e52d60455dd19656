"""Dynamic sampling in the simulator (DAPO, Yu et al. 2025, arXiv:2503.14476, Sec. 3.2; the runtime's loop is
``run.dynamic_sampling``): each generation batch of ``P`` prompts keeps a Binomial(P, keep-rate) number of
groups (``workload.filter_keep_rate``: the expected share whose responses do not all score alike), and the
step generates batches until ``P`` groups are kept. Its generation is the drawn number of batches, each
priced like the first (the same prompts per batch, lengths from the same distribution)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from nereus.spec.job import JobSpec

# A step draws batches until it keeps P groups; past this many the keep-rate is taken as broken input
# (a keep-rate of 1e-3 with P = 16 needs ~1,000 batches on average)
MAX_BATCHES = 100_000


@dataclass(frozen=True)
class DrawnBatches:
    """A simulated step's dynamic sampling: generation batches, groups generated and groups kept."""

    batches: int
    generated: int
    kept: int

    def metrics(self) -> dict[str, float]:
        """The runtime's names (``rl.dapo.FilterTally.metrics``)."""
        return {"train/num_gen_batches": float(self.batches),
                "train/filter_groups_keep_rate": self.kept / self.generated if self.generated else 1.0}


def draw_batches(rng: np.random.Generator, keep_rate: float, groups: int) -> DrawnBatches:
    """Generation batches of ``groups`` prompts until ``groups`` are kept, each keeping Binomial(groups,
    ``keep_rate``) of them."""
    if not 0 < keep_rate <= 1:
        raise ValueError(f"keep_rate must be in (0, 1], not {keep_rate}")
    batches = kept = 0
    while kept < groups and batches < MAX_BATCHES:
        kept += int(rng.binomial(groups, keep_rate))
        batches += 1
    return DrawnBatches(batches, batches * groups, kept)


def one_batch(job: JobSpec) -> JobSpec:
    """``job`` priced for one generation batch a step (the simulator draws how many the step takes)."""
    return replace(job, workload=replace(job.workload, filter_keep_rate=1.0))


def scale_generation(stage_times: dict[str, float], phases: dict[str, float], batches: int) -> None:
    """The generation stage and phase of a step that generated ``batches`` batches (in place)."""
    for name in stage_times:
        if name.split("/")[1] == "generation":
            stage_times[name] *= batches
    phases["generation"] *= batches
