"""Failures injected into a simulated RL job: what fails, how often, and when (seeded).

The mix of root causes is Meta's count of the 419 unexpected interruptions of Llama 3 405B pre-training
(16,384 H100 GPUs, 54 days; Llama Team 2024, arXiv:2407.21783, Table 5), grouped by what each does to an
RL job:

- ``process``: the process on one GPU dies. Faulty GPU 148, HBM3 72, GPU SRAM 19, GPU system processor
  17, silent data corruption 6, thermal interface and sensor 6 (GPU, 268), software bug 54, dependency
  2 (56). Which RL kind it becomes depends on what the GPU was doing then (``kind_of``): generating (a
  rollout-engine crash), a forward or backward pass (a trainer rank crash), sending weights to the engines
  (a crash during weight sync) or a layout change (a crash during a live transition).
- ``node``: the whole machine is gone. Host maintenance 32, NIC 7, SSD 3, power supply 3, chassis 2,
  IO expansion board 2, CPU 2, system memory 2 (53).
- ``partition``: one machine is cut off the network. Network switch or cable 35, NCCL watchdog
  timeouts 7 (42).

Stragglers are not interruptions, so Table 5 has none. Falcon (Wu et al. 2024, arXiv:2410.12588, §2)
finds fail-slow GPUs and links on a 10,000-GPU production cluster lasting from tens of seconds to about
ten hours, and that practice treats one as a fail-stop once an operator spots it. No study we found gives
fail-slow counts beside fail-stop counts, so their share, slowdown and time to spot are assumptions
(``FaultModel`` fields), the same for every system compared.

``failure_fraction`` is the share of the job's machines that fail over the failure-free run, as RL
fault-tolerance papers inject failures (RobustRL, Chen et al. 2025, arXiv:2512.22492: "10% failure
injection" on 256 GPUs). It sets a Poisson rate per wall-clock second, so a system that runs longer meets
more failures. Failure times are seeded unit-rate arrivals divided by that rate (so for one seed a higher
fraction never gives fewer failures, and the n-th failure keeps its cause), each cause a seeded draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# the failure kinds a report lists, in print order
ROLLOUT_CRASH = "rollout_crash"
TRAINER_CRASH = "trainer_crash"
WEIGHT_SYNC_CRASH = "weight_sync_crash"
TRANSITION_CRASH = "transition_crash"
NODE_LOSS = "node_loss"
PARTITION = "partition"
STRAGGLER = "straggler"
KINDS = (ROLLOUT_CRASH, TRAINER_CRASH, WEIGHT_SYNC_CRASH, TRANSITION_CRASH, NODE_LOSS, PARTITION, STRAGGLER)
WHILE_RECOVERING = "while_recovering"  # a fail-stop that lands while the job recovers from another one

# the phase a GPU is in when its process dies -> the kind of crash (phases as StepMetrics.phase_times_s;
# "snapshot" and "checkpoint" are the recovery mechanisms' own work, done by the trainer ranks)
PHASE_KINDS = {"generation": ROLLOUT_CRASH, "inference": TRAINER_CRASH, "training": TRAINER_CRASH,
               "weight_sync": WEIGHT_SYNC_CRASH, "transition": TRANSITION_CRASH, "replan": TRANSITION_CRASH,
               "snapshot": TRAINER_CRASH,
               "checkpoint": TRAINER_CRASH}


@dataclass(frozen=True)
class RootCause:
    """One row group of a published failure table: how many interruptions, and what each does to a job."""

    name: str
    count: int
    effect: str  # "process", "node" or "partition"


# Llama 3 405B pre-training, arXiv:2407.21783 Table 5 (419 unexpected interruptions), grouped by effect
LLAMA3_CAUSES = (
    RootCause("GPU (faulty GPU, HBM3, SRAM, system processor, SDC, thermal)", 268, "process"),
    RootCause("software (bug, dependency)", 56, "process"),
    RootCause("host (maintenance, NIC, SSD, power, chassis, IO board, CPU, memory)", 53, "node"),
    RootCause("network (switch or cable, NCCL watchdog timeout)", 42, "partition"),
)
LLAMA3_INTERRUPTIONS, LLAMA3_GPUS, LLAMA3_DAYS = 419, 16384, 54


def llama3_gpu_hours_per_failure() -> float:
    """Mean GPU-hours between unexpected interruptions in Llama 3 pre-training (about 50,700)."""
    return LLAMA3_GPUS * LLAMA3_DAYS * 24 / LLAMA3_INTERRUPTIONS


@dataclass(frozen=True)
class FaultModel:
    failure_fraction: float  # share of the job's machines failing over the failure-free run
    causes: tuple[RootCause, ...] = LLAMA3_CAUSES
    straggler_share: float = 0.1  # fail-slow events among all events (an assumption, see the module doc)
    straggler_slowdown: float = 1.5  # a synchronous step's time while one node is slow (an assumption)
    straggler_spot_s: float = 600.0  # until a slow node is spotted and treated as failed (an assumption)

    def __post_init__(self) -> None:
        if not 0.0 <= self.failure_fraction <= 10.0:
            raise ValueError(f"failure_fraction must be in [0, 10], not {self.failure_fraction}")
        if not 0.0 <= self.straggler_share < 1.0:
            raise ValueError(f"straggler_share must be in [0, 1), not {self.straggler_share}")

    def shares(self) -> dict[str, float]:
        """Probability of each effect per event: process, node, partition, straggler (sums to 1)."""
        total = sum(c.count for c in self.causes)
        out = {"process": 0.0, "node": 0.0, "partition": 0.0}
        for c in self.causes:
            out[c.effect] += (1.0 - self.straggler_share) * c.count / total
        out["straggler"] = self.straggler_share
        return out

    def rate_per_s(self, nodes: int, run_s: float) -> float:
        """Events per wall-clock second: ``failure_fraction`` × nodes over the failure-free run."""
        return self.failure_fraction * nodes / run_s if run_s > 0 else 0.0

    def gpu_hours_per_failure(self, gpus: int, nodes: int, run_s: float) -> float:
        """Mean GPU-hours between events this model implies (compare ``llama3_gpu_hours_per_failure``)."""
        rate = self.rate_per_s(nodes, run_s)
        return gpus / rate / 3600 if rate > 0 else float("inf")


@dataclass(frozen=True)
class FaultEvent:
    """One injected failure: when it strikes and what it takes down (the runtime's own fault hooks are
    ``runtime.comm.faults.Fault``)."""

    t_s: float  # wall-clock seconds from the job's start
    effect: str  # "process", "node", "partition" or "straggler"


def draw_faults(model: FaultModel, nodes: int, run_s: float, horizon_s: float, seed: int) -> tuple[FaultEvent, ...]:
    """Failures up to ``horizon_s`` (the longest a compared run may take): a Poisson process at
    ``model.rate_per_s``. The unit-rate arrival times and the causes are drawn from ``seed`` alone, so
    every system meets the same failures at the same wall-clock times."""
    rate = model.rate_per_s(nodes, run_s)
    if rate <= 0:
        return ()
    rng = np.random.default_rng([seed, 52])
    effects = list(model.shares().items())
    cumulative = np.cumsum([p for _, p in effects])
    faults: list[FaultEvent] = []
    unit_t = 0.0
    while True:  # the arrival draw and the cause draw alternate, so each event's cause is its own
        unit_t += rng.exponential(1.0)
        u = rng.random()
        if unit_t / rate > horizon_s:
            return tuple(faults)
        index = min(int(np.searchsorted(cumulative, u, side="right")), len(effects) - 1)
        faults.append(FaultEvent(unit_t / rate, effects[index][0]))


def kind_of(effect: str, phase: str) -> str:
    """The kind a failure is reported as: a dead process by the phase it died in, else by its effect."""
    if effect == "process":
        return PHASE_KINDS[phase]
    return {"node": NODE_LOSS, "partition": PARTITION, "straggler": STRAGGLER}[effect]
