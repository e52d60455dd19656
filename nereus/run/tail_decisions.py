"""The plan's tail levers in a step's generation on the runtime (``Plan.levers``, chosen by the policy:
``control.tail_policy``), as the simulator carries them out (``sim.backend``):

- **speculative decoding** is a decision at the start of the generation: the backend asks the policy
  (``Policy.during_generation``) with the plan's levers in the status; a ``SetSpeculation`` answer sets
  the call's n-gram speculation (``SamplingParams.speculation``), and the decision goes into the run
  record with the drafts verified and accepted once the call has answered (the policy calibrates its
  acceptance on them, ``control.tail_policy.NereusLevers.observe``);
- **tail batching** is a property of the step's round (``run.tail``), over-launched as the plan says.

One generation call has one decision point, its start; the engine with decision points
(``run.midstep``) asks again between chunks.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Collection
from dataclasses import dataclass, replace

from nereus.control.backend import GenerationPolicy
from nereus.runtime.engines.answers import DecodeStats
from nereus.runtime.engines.sampling import SamplingParams
from nereus.spec.engines import DEFAULT_ENGINE, ENGINE_TRAITS
from nereus.spec.generation import (
    GenerationDecision,
    GenerationEntry,
    GenerationStatus,
    Outcome,
    ReplicaStatus,
    SequenceRecord,
    SetSpeculation,
)
from nereus.spec.levers import GenerationLevers, Speculation

STAGE = "actor/generation"


def engine_speculation(lever: Speculation | None, drafts: Collection[str]) -> Speculation | None:
    """The plan's speculation lever as the engine carries it out (the same value; None: off); a
    ``ValueError`` naming the kind for a draft the engine does not make (``drafts``: its
    ``EngineTraits.drafts``; the native engine's n-gram proposer serves n-gram and suffix drafts, its own
    text and its siblings', not a draft model or head)."""
    if lever is not None and lever.draft not in drafts:
        raise ValueError(f"the runtime's engines draft {' and '.join(drafts)} only, not {lever.draft}")
    return lever


def queued(prompts: list[list[int]], dp: int) -> tuple[ReplicaStatus, ...]:
    """Every replica's status before its first iteration: its block of rows queued (the rows
    ``ShardedModel.replica_rows`` gives it, consecutive blocks in DP order)."""
    per = len(prompts) // dp
    return tuple(ReplicaStatus(d, (), tuple(SequenceRecord(i, d, len(prompts[i]), 0, 0)
                                            for i in range(d * per, (d + 1) * per))) for d in range(dp))


@dataclass(frozen=True)
class StartDecision:
    """The policy's answer at the start of a one-call generation and the call's parameters under it;
    ``refused``: why the runtime did not carry out a decision that acts ("" when it did)."""

    status: GenerationStatus
    decision: GenerationDecision
    overhead_s: float
    params: SamplingParams
    refused: str = ""

    def entries(self, stats: DecodeStats) -> tuple[GenerationEntry, ...]:
        """The run record's entry for the decision (none for one that was not to be recorded), with the
        call's speculation counters (``stats``, summed over the replicas)."""
        d = self.decision
        if not d.recorded:
            return ()
        if self.refused or not d.acts:
            outcome = Outcome(False, self.refused or "declined")
        else:
            outcome = Outcome(True, "", 0.0, None, {"verifications": float(stats.verifications),
                                                     "draft_tokens": float(stats.draft_tokens),
                                                     "accepted_tokens": float(stats.accepted_tokens)})
        s = self.status
        return (GenerationEntry(s.step, STAGE, s.iteration, s.live, d, outcome, self.overhead_s),)


def ask_at_start(policy: GenerationPolicy, step: int, prompts: list[list[int]], params: SamplingParams, dp: int,
                 levers: GenerationLevers | None,
                 drafts: Collection[str] = ENGINE_TRAITS[DEFAULT_ENGINE].drafts) -> StartDecision:
    """Ask ``policy`` at the start of step ``step``'s generation of ``prompts`` on ``dp`` replicas; carry
    out a ``SetSpeculation`` on the call's ``params`` (``drafts``: the draft kinds the engine makes). Other
    decisions need points the call does not have: they are recorded as not carried out."""
    status = GenerationStatus(step, STAGE, "start", 0, params.slots, params.max_new_tokens, queued(prompts, dp),
                              levers=levers)
    t0 = time.perf_counter()
    d = policy.during_generation(status)
    overhead = time.perf_counter() - t0
    if isinstance(d, SetSpeculation):
        try:
            speculation = engine_speculation(d.speculation, drafts)
            return StartDecision(status, d, overhead, replace(params, speculation=speculation))
        except ValueError as err:
            return StartDecision(status, d, overhead, params, str(err))
    refused = f"a generation in one call carries out speculation only, not {d.kind}" if d.acts else ""
    return StartDecision(status, d, overhead, params, refused)


# plain steps (no lever, the same plan) a lever's measured gain is taken against: the latest ones
PLAIN_WINDOW = 10
# the lever rule's own figures in ``GenerationLevers.predicted`` (the others are its runner-ups' seconds)
SUMMARY_KEYS = ("gain_s", "base_s", "step_s", "generation_s")


@dataclass
class LeverSpan:
    """Consecutive steps run under one lever setting: the plan's predicted step with and without them, the
    measured steps, and the measured plain steps it is compared with: the median of the last ones run on
    the same plan without levers (none: the calibrated model's plain step, ``base_s``, stands for them)."""

    first_step: int
    kinds: str
    base_s: float
    predicted_s: float
    measured_s: list[float]
    plain_s: float | None = None

    @property
    def predicted_gain_s(self) -> float:
        return self.base_s - self.predicted_s

    @property
    def reference_s(self) -> float:
        return self.plain_s if self.plain_s is not None else self.base_s

    @property
    def measured_gain_s(self) -> float:
        return self.reference_s - statistics.median(self.measured_s)

    def line(self) -> str:
        last = self.first_step + len(self.measured_s)
        against = ("the median plain step before it" if self.plain_s is not None
                   else "the calibrated plain step: no plain step measured on this plan")
        return (f"  {self.kinds} in steps {self.first_step + 1}-{last}: step {self.base_s:.3f} s -> "
                f"{self.predicted_s:.3f} s predicted (gain {self.predicted_gain_s:+.3f} s); measured "
                f"{statistics.median(self.measured_s):.3f} s against {self.reference_s:.3f} s, {against} "
                f"(gain {self.measured_gain_s:+.3f} s)")


class LeverLog:
    """The tail levers a run used (``run.rollout.levers: auto``): a line whenever the plan's levers change
    (the choice, its predicted step, the runner-ups), per-step metrics, and a summary per setting."""

    def __init__(self) -> None:
        self.spans: list[LeverSpan] = []
        self.chosen: GenerationLevers | None = None
        self.plain: list[float] = []  # measured steps without levers on the plan in force

    def step_done(self, step: int, ran: GenerationLevers | None, measured_s: float, nxt: GenerationLevers | None,
                  same_plan: bool = True) -> tuple[dict[str, float], str | None]:
        """After step ``step`` run under ``ran`` (measured ``measured_s``), with ``nxt`` for the next step
        (``same_plan``: on the same placements): its ``nereus/levers/*`` metrics and a line when the levers
        change."""
        on = ran is not None and ran.any
        if on:
            kinds, p = ran.kinds, ran.predicted
            base, pred = float(p.get("base_s", 0.0)), float(p.get("step_s", p.get("generation_s", 0.0)))
            last = self.spans[-1] if self.spans else None
            if last is None or last.kinds != kinds or last.first_step + len(last.measured_s) != step:
                plain = statistics.median(self.plain[-PLAIN_WINDOW:]) if self.plain else None
                self.spans.append(LeverSpan(step, kinds, base, pred, [], plain))
            self.spans[-1].measured_s.append(measured_s)
        else:
            self.plain.append(measured_s)
        if not same_plan:  # the next steps run on other placements: what was measured here says nothing there
            self.plain = []
        metrics = {"nereus/levers/on": float(on),
                   "nereus/levers/predicted_gain_s": self.spans[-1].predicted_gain_s if on else 0.0,
                   "nereus/levers/measured_gain_s": self.spans[-1].reference_s - measured_s if on else 0.0}
        nxt = nxt if nxt is not None and (nxt.any or nxt.predicted) else None  # none priced: none chosen
        line = change_line(step + 1, nxt) if nxt != self.chosen else None  # equal: the same levers, re-priced
        self.chosen = nxt
        return metrics, line

    def summary(self) -> list[str]:
        """One line per lever setting the run used."""
        return [s.line() for s in self.spans]


def change_line(step: int, levers: GenerationLevers | None) -> str:
    """A line of progress for the levers of step ``step`` (0-based)."""
    if levers is None:
        return f"\n  levers from step {step + 1}: none"
    p = levers.predicted
    if not levers.any:  # declined: the best priced did not beat the calibration's error
        best = min(((k[:-2], v) for k, v in p.items() if k.endswith("_s") and k not in SUMMARY_KEYS),
                   key=lambda kv: kv[1], default=("none", p.get("base_s", 0.0)))
        return (f"\n  levers from step {step + 1}: none (best priced: {best[0]} {best[1]:.3f} s against "
                f"{p.get('base_s', 0.0):.3f} s plain, a gain within the calibration's "
                f"{100 * p.get('residual', 0.0):.0f}% error)")
    what = []
    if levers.speculation is not None:
        s = levers.speculation
        what.append(f"speculation ({s.draft} drafts, k={s.draft_tokens}, while <= {s.live_at_most} live)")
    if levers.tail_batching is not None:
        what.append(f"tail batching (over-launch {levers.tail_batching.over_launch:g})")
    others = ", ".join(f"{k[:-2]} {v:.3f} s" for k, v in p.items() if k.endswith("_s") and k not in SUMMARY_KEYS)
    step_s = p.get("step_s", p.get("generation_s", 0.0))
    return (f"\n  levers from step {step + 1}: {' + '.join(what)}; predicted step {p.get('base_s', 0.0):.3f} s -> "
            f"{step_s:.3f} s" + (f" (priced: {others})" if others else ""))
