"""A failure-free run replayed under injected failures, once per recovery mechanism, on one wall clock.

The failure-free run (``StepTimeline``: each step's phases from the simulator, and the live transitions
between steps) is the productive work; ETTR is that work's time over the wall time the replay took
(ByteRobust's effective training time ratio, Wan et al. 2025, arXiv:2509.16293). Failures
(``sim.faults``) arrive at fixed wall-clock times, the same for every mechanism:

- ``live`` (Nereus, docs/reliability.md): every step starts with a host-memory snapshot. A dead process,
  node or cut-off node costs the time until it is noticed, re-forming the world, re-sharding every model
  onto the survivors, and redoing the step in flight (none when the step had finished: a crash during
  the transition or disk checkpoint after it). The job runs on the survivors, slower by nodes / survivors,
  until a replacement node joins with a live transition. A straggler slows every step until it is
  spotted, then the controller re-plans off its node at a step boundary; nothing is redone.
- ``restart`` (verl, OpenRLHF): a disk checkpoint every K steps. A failure costs the time until it is
  noticed, a relaunch (scheduler, containers, engines, with a replacement node) and reading the last
  checkpoint, and every step since that checkpoint is run again. A spotted straggler is killed and
  restarted the same way (Falcon, arXiv:2410.12588, §2: practice treats fail-slows as fail-stops).

A failure that lands while the job is recovering restarts that recovery.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from nereus.sim.faults import KINDS, STRAGGLER, WHILE_RECOVERING, FaultEvent, kind_of


@dataclass(frozen=True)
class StepTimeline:
    """A failure-free run: each step's phases in order (seconds) and the live transition after it."""

    phases: tuple[tuple[tuple[str, float], ...], ...]
    transition_s: tuple[float, ...]
    samples_per_step: int
    nodes: int

    def __post_init__(self) -> None:
        if len(self.phases) != len(self.transition_s):
            raise ValueError(f"{len(self.phases)} steps but {len(self.transition_s)} transitions")

    @property
    def steps(self) -> int:
        return len(self.phases)

    def step_s(self, i: int) -> float:
        return sum(s for _, s in self.phases[i])

    @property
    def productive_s(self) -> float:
        return sum(self.step_s(i) for i in range(self.steps))


@dataclass(frozen=True)
class LiveRecovery:
    """Nereus's recovery. Defaults: the runtime's measured figures (docs/reliability.md) and Ray's."""

    detect_process_s: float = 0.0  # a dead worker process shows at once (the lost-worker run)
    detect_node_s: float = 50.0  # Ray's GCS health check: 5 failed checks of up to 10 s (ray_config_def.h)
    reform_s: float = 0.10  # re-forming the world, measured (lost worker: 0.10 s, lost node: 0.05 s)
    restore_s: float = 0.46  # rebuilding the state from images, measured at 4 workers
    comm_init_s: float = 10.0  # communicator set-up at 1,024 ranks: an assumption, not measured
    reshard_s: float = 0.0  # the cost model's transition onto the survivors
    regrow_s: float = 0.0  # the cost model's transition back onto a replacement node
    snapshot_s: float = 0.0  # the host-memory snapshot at the start of every step
    spare_s: float = 300.0  # until a replacement node joins (the restart's relaunch wait)
    checkpoint_every: int = 50  # disk checkpoints still run (run.checkpoint.every's example value)
    checkpoint_s: float = 0.0

    def recover_s(self) -> float:
        return self.reform_s + self.restore_s + self.comm_init_s + self.reshard_s


@dataclass(frozen=True)
class RestartRecovery:
    """Checkpoint-restart, as verl runs it."""

    detect_process_s: float = 0.0  # the driver's ray.get raises on a dead actor at once
    detect_node_s: float = 50.0  # as Nereus: Ray declares the node dead
    relaunch_s: float = 300.0  # scheduler, containers, workers, engines (sim.run.Recovery.restart_s)
    load_s: float = 0.0  # reading the checkpoint, nodes in parallel
    checkpoint_every: int = 20  # trainer.save_freq of most of verl's example scripts
    checkpoint_s: float = 0.0


@dataclass(frozen=True)
class ReplayResult:
    system: str
    wall_s: float
    productive_s: float
    failures: dict[str, int] = field(default_factory=dict)  # kind -> count
    lost_s: dict[str, float] = field(default_factory=dict)  # kind -> wall seconds it cost
    steps_lost: int = 0  # steps run again
    samples_lost: int = 0  # samples generated and thrown away with them
    overhead_s: float = 0.0  # snapshots, checkpoints and planned transitions, failures or not

    @property
    def ettr(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 1.0

    @property
    def failure_count(self) -> int:
        return sum(self.failures.values())

    def to_dict(self) -> dict:
        return {"system": self.system, "ettr": self.ettr, "wall_s": self.wall_s, "productive_s": self.productive_s,
                "failures": {k: self.failures.get(k, 0) for k in (*KINDS, WHILE_RECOVERING)},
                "lost_s": dict(self.lost_s),
                "steps_lost": self.steps_lost, "samples_lost": self.samples_lost, "overhead_s": self.overhead_s}


Part = tuple[str, float, bool]  # phase, seconds, whether it is the step's own work


def phase_at(parts: list[Part], elapsed: float) -> tuple[int, str]:
    """The index and name of the part running ``elapsed`` seconds into ``parts`` (the last one after)."""
    at = 0.0
    for index, (name, seconds, _) in enumerate(parts):
        if elapsed < at + seconds:
            return index, name
        at += seconds
    return len(parts) - 1, parts[-1][0]


class _Replay:
    """What both mechanisms track: the clock, the next failure, and what the failures cost."""

    def __init__(self, timeline: StepTimeline, faults: tuple[FaultEvent, ...], straggler_slowdown: float,
                 straggler_spot_s: float) -> None:
        self.timeline, self.faults = timeline, faults
        self.slowdown, self.spot_after = straggler_slowdown, straggler_spot_s
        self.t, self.i, self.next = 0.0, 0, 0
        self.failures: Counter[str] = Counter()
        self.lost: Counter[str] = Counter()  # by kind, and "survivors_slower" (live: fewer nodes)
        self.steps_lost = self.samples_lost = 0
        self.overhead = 0.0
        self.spot_at: float | None = None  # a slow node is spotted then
        self.slowed = False  # the current step runs with a straggler

    def take(self, end: float) -> FaultEvent | None:
        """The next fail-stop before ``end``, consumed; one that fell while recovering lands now. A
        straggler on the way slows the steps that start after it, until it is spotted."""
        while self.next < len(self.faults) and self.faults[self.next].t_s < end:
            self.next += 1
            fault = self.faults[self.next - 1]
            if fault.effect != "straggler":
                return fault
            self.failures[STRAGGLER] += 1
            if self.spot_at is None:
                self.spot_at = fault.t_s + self.spot_after
        return None

    def step_parts(self, factor: float) -> list[Part]:
        """The current step's phases on ``factor`` times fewer devices, slowed while a straggler runs."""
        self.slowed = self.spot_at is not None
        slow = self.slowdown if self.slowed else 1.0
        return [(name, s * factor * slow, True) for name, s in self.timeline.phases[self.i]]

    def book_straggler(self, worked: float, factor: float) -> None:
        """The part of a finished step's ``worked`` seconds a straggler added."""
        if self.slowed:
            self.lost[STRAGGLER] += worked - self.timeline.step_s(self.i) * factor

    def lose_steps(self, n: int) -> None:
        self.steps_lost += n
        self.samples_lost += n * self.timeline.samples_per_step

    def result(self, system: str) -> ReplayResult:
        return ReplayResult(system, self.t, self.timeline.productive_s, dict(self.failures), dict(self.lost),
                            self.steps_lost, self.samples_lost, self.overhead)


def replay_live(timeline: StepTimeline, faults: tuple[FaultEvent, ...], cost: LiveRecovery,
                straggler_slowdown: float = 1.5, straggler_spot_s: float = 600.0) -> ReplayResult:
    """Nereus: lose at most the step in flight; run on the survivors until a replacement joins."""
    r = _Replay(timeline, faults, straggler_slowdown, straggler_spot_s)
    spares: list[float] = []  # when each node out of the plan has a replacement
    while r.i < timeline.steps:
        parts = _live_boundary(r, spares, cost)
        factor = timeline.nodes / max(1, timeline.nodes - len(spares))  # survivors share the step
        first_step_part = len(parts) + 1
        parts += [("snapshot", cost.snapshot_s, False)] + r.step_parts(factor)
        last_step_part = len(parts) - 1
        parts += [("transition", timeline.transition_s[r.i], False)]
        if (r.i + 1) % cost.checkpoint_every == 0:
            parts.append(("checkpoint", cost.checkpoint_s, False))
        total = sum(s for _, s, _ in parts)
        fault = r.take(r.t + total)
        if fault is None:
            _book_live_step(r, parts, total, factor)
            r.t, r.i = r.t + total, r.i + 1
            continue
        at = max(fault.t_s, r.t)
        index, phase = phase_at(parts, at - r.t)
        kind = WHILE_RECOVERING if fault.t_s < r.t else kind_of(fault.effect, phase)
        r.failures[kind] += 1
        detect = cost.detect_process_s if fault.effect == "process" else cost.detect_node_s
        if index > last_step_part:  # the step had finished: keep it, drop the transition or checkpoint
            _book_live_step(r, parts, at - r.t, factor)
            r.lost[kind] += detect + cost.recover_s()
            r.i += 1
        else:
            r.lose_steps(1 if index >= first_step_part and fault.t_s >= r.t else 0)
            r.lost[kind] += at - r.t + detect + cost.recover_s()
        r.t = at + detect + cost.recover_s()
        spares.append(at + cost.spare_s)
    return r.result("nereus")


def _live_boundary(r: _Replay, spares: list[float], cost: LiveRecovery) -> list[Part]:
    """Between steps: re-plan off a spotted slow node, or onto replacements that have joined; the move
    is the first part of the next step's segment."""
    if r.spot_at is not None and r.t >= r.spot_at:
        r.spot_at = None
        spares.append(r.t + cost.spare_s)
        return [("replan", cost.reshard_s, False)]
    joined = [s for s in spares if s <= r.t]
    for s in joined:
        spares.remove(s)
    return [("transition", cost.regrow_s, False)] if joined else []


def _book_live_step(r: _Replay, parts: list[Part], elapsed: float, factor: float) -> None:
    """Where the ``elapsed`` seconds of a step kept went: the failure-free step, a straggler's and the
    missing nodes' slowdown, a re-plan off a slow node, and the rest (snapshot, transitions, checkpoint)."""
    step_s = r.timeline.step_s(r.i)
    worked = sum(s for _, s, is_step in parts if is_step)
    replan = sum(s for name, s, _ in parts if name == "replan")
    r.book_straggler(worked, factor)
    r.lost[STRAGGLER] += replan
    r.lost["survivors_slower"] += step_s * (factor - 1.0)
    r.overhead += elapsed - worked - replan


def replay_restart(timeline: StepTimeline, faults: tuple[FaultEvent, ...], cost: RestartRecovery,
                   straggler_slowdown: float = 1.5, straggler_spot_s: float = 600.0) -> ReplayResult:
    """Checkpoint-restart: every failure sends the job back to its last complete disk checkpoint."""
    r = _Replay(timeline, faults, straggler_slowdown, straggler_spot_s)
    last_checkpoint, since_s = 0, 0.0  # steps the last checkpoint holds; wall seconds of steps since
    while r.i < timeline.steps:
        if r.spot_at is not None and r.t >= r.spot_at:  # the slow node spotted: kill, relaunch without it
            r.lost[STRAGGLER] += since_s + cost.relaunch_s + cost.load_s
            r.lose_steps(r.i - last_checkpoint)
            r.t += cost.relaunch_s + cost.load_s
            r.i, since_s, r.spot_at = last_checkpoint, 0.0, None
            continue
        parts = r.step_parts(1.0)
        writes = (r.i + 1) % cost.checkpoint_every == 0
        if writes:
            parts.append(("checkpoint", cost.checkpoint_s, False))
        end = r.t + sum(s for _, s, _ in parts)
        fault = r.take(end)
        if fault is None:
            r.book_straggler(sum(s for _, s, is_step in parts if is_step), 1.0)
            r.overhead += cost.checkpoint_s if writes else 0.0
            since_s += timeline.step_s(r.i)  # a straggler's share stays booked to it
            r.t, r.i = end, r.i + 1
            if writes:
                last_checkpoint, since_s = r.i, 0.0
            continue
        at = max(fault.t_s, r.t)
        _, phase = phase_at(parts, at - r.t)
        kind = WHILE_RECOVERING if fault.t_s < r.t else kind_of(fault.effect, phase)
        r.failures[kind] += 1
        r.lose_steps(r.i - last_checkpoint + (fault.t_s >= r.t))  # since the checkpoint, and the one in flight
        detect = cost.detect_process_s if fault.effect == "process" else cost.detect_node_s
        r.lost[kind] += since_s + (at - r.t) + detect + cost.relaunch_s + cost.load_s
        r.t = at + detect + cost.relaunch_s + cost.load_s
        r.i, since_s, r.spot_at = last_checkpoint, 0.0, None  # the relaunch replaces the slow node too
    return r.result("restart")
