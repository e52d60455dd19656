"""What a real run pays that the planner's cost model does not price: the structural terms of the
simulator's ground truth.

The truth's times are the cost model's under hidden per-term efficiencies (``sim.backend``); on top of
them every step pays what published runs show and ``estimate_plan`` leaves out:

- **the driver's pass** (host overhead and padding): a single-controller trainer moves every stage call's
  batch through one driver process, each sequence padded to the length caps (``cost.controller``, priced
  per padded token slot; its constant is fitted on named published cells and reported on all the others,
  docs/cost-model.md "End-to-end RL runs"). Every plan pays it, Nereus's as well as the baselines': its
  runtime is single-controller too, and the truth charges the padded width (the conservative side);
- **stragglers**: a synchronous stage runs at the pace of its slowest GPU. Identical-SKU GPUs differ in
  speed through manufacturing and power management: 8% average (22% at most) performance variation
  across the GPUs of large clusters, persistent per GPU (Sinha et al., "Not All GPUs Are Created Equal",
  SC 2022). Each GPU's speed is drawn once per cluster (seed), log-normal with ``STRAGGLER_SIGMA``
  around 1, and a stage's time is scaled by the slowest of its placement's GPUs.

A published run is one draw of a real cluster; the validation compares it with the truth's mean over
seeds (``sim.published_predict.SIM_SEEDS``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from nereus.cost.controller import controller_time
from nereus.spec.job import JobSpec
from nereus.spec.layout import Plan

# Log-normal sigma of one GPU's slowness: over a cluster of a few thousand GPUs (about ±3.3 sigma) the
# fastest and slowest differ by ≈ 13%, between the 8% average and the 22% largest variation Sinha et al.
# (SC 2022) measured on identical GPUs.
STRAGGLER_SIGMA = 0.02
# Seed stream of the per-GPU speeds, apart from the hidden factors' and the per-step draws'.
_SPEED_STREAM = 11


@dataclass(frozen=True)
class Reality:
    """The structural terms the truth adds. ``padded_slots``: token slots a sequence occupies on the
    driver's path; 0 takes the step's (prompt length + the rollout's response cap)."""

    driver: bool = True
    straggler_sigma: float = STRAGGLER_SIGMA
    padded_slots: int = 0


# The truth without structural terms: the cost model under hidden factors alone (a scenario set on it).
NO_REALITY = Reality(driver=False, straggler_sigma=0.0)


def gpu_slowness(seed: int, gpus: int, sigma: float) -> np.ndarray:
    """Each GPU's time factor, fixed for the cluster ``seed`` draws: log-normal with mean 1."""
    rng = np.random.default_rng((seed, _SPEED_STREAM))
    return np.exp(rng.normal(-sigma**2 / 2, sigma, size=gpus)) if sigma > 0 else np.ones(gpus)


def driver_seconds(reality: Reality, job: JobSpec, response_cap: int) -> float:
    """One stage call's pass through the driver: the step's sequences at their padded width (the prompt
    and the rollout's response cap at this step)."""
    if not reality.driver:
        return 0.0
    slots = reality.padded_slots or job.workload.prompt_length + response_cap
    return controller_time(job.sequences_per_step(), slots)


def straggler_factor(slowness: np.ndarray, gpus: tuple[int, ...]) -> float:
    """A synchronous stage's time factor: its slowest GPU's (vectorised: it runs per stage every step)."""
    at = np.fromiter(gpus, np.int64, len(gpus))
    at = at[(at >= 0) & (at < len(slowness))]
    return float(slowness[at].max()) if len(at) else 1.0


@dataclass(frozen=True)
class RealityAdded:
    """What the structural terms added to a step: each stage call's driver seconds and each phase's
    straggler factor (for the step's timeline)."""

    driver_s: float
    phase_factors: dict[str, float]


def apply_reality(reality: Reality, slowness: np.ndarray, plan: Plan, job: JobSpec, response_cap: int,
                  stage_times: dict[str, float], phases: dict[str, float]) -> RealityAdded:
    """Scales each model-stage by its slowest GPU and each phase by its slowest stage's factor, and adds
    every stage call's driver pass to its stage and, the driver being one process, to its phase in
    sequence (in place)."""
    moved = driver_seconds(reality, job, response_cap)
    factors: dict[str, float] = {}
    calls: dict[str, int] = {}
    for name, seconds in stage_times.items():
        if seconds <= 0 or not math.isfinite(seconds):
            continue
        stage = name.split("/")[1]
        factor = straggler_factor(slowness, plan.placement(name).gpus)
        stage_times[name] = seconds * factor + moved
        factors[stage] = max(factors.get(stage, 1.0), factor)
        calls[stage] = calls.get(stage, 0) + 1
    for stage, factor in factors.items():
        phases[stage] = phases[stage] * factor + calls[stage] * moved
    return RealityAdded(moved, factors)
