"""Inside the generation stage: what a backend and a policy exchange at the stage's decision points.

Generation runs to *decision points*. At each one the backend (the simulator's generation loop, the
runtime's engine loop) builds a ``GenerationStatus`` — the step, the model-stage, where the stage stands
(``point``, ``iteration``), every DP replica's unfinished sequences as ``SequenceRecord``\\ s and what was
measured so far — and calls ``Policy.during_generation(status)`` (``control.backend``). The answer is one
``GenerationDecision``:

======================  ===========================================================================
``continue``            nothing to do now; look again at ``look`` (``NextLook``: after some engine
                        iterations, or once few sequences are left), or never again in this step
``move_sequences``      move unfinished sequences between replicas of the stage's layout (their KV
                        caches travel, or the receiver re-prefills them)
``change_tail_layout``  switch the stage to a tail layout (``TailPhase``) for its remaining sequences
``set_speculation``     draft-and-verify decoding (``Speculation``) on every replica whose live batch is
                        at most its threshold, or off
``defer_sequences``     end the round now: the unfinished groups' partial responses are dropped and their
                        prompts deferred to a later round (tail batching; policy lag 0)
``carry_over``          end the round now: the unfinished responses keep their tokens and resume in the
                        next step (partial rollout; their tokens then train one step late)
======================  ===========================================================================

The levers a plan may carry for its generation stage are ``spec.levers.GenerationLevers`` (``Plan.levers``):
configuration the policy chose between steps, which it turns into the decisions above inside the step.

Every decision carries the next decision point (``look``) and, when it acts, the gain and cost the
policy predicts; a ``continue`` may carry the move it weighed and declined. The backend applies what it
can (the runtime moves sequences between replicas; the simulator switches tail layouts) and records
every acting or declined decision with its ``Outcome`` as one ``GenerationEntry`` (``RunRecord``).

A new kind of decision is one new frozen class here, listed in ``DECISION_KINDS``: the JSON codec is
generic over the dataclass fields. Plain data only; the modules below ``spec`` and every backend import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from types import MappingProxyType
from typing import Any, ClassVar

from nereus.spec.errors import SpecError, check_format
from nereus.spec.levers import GenerationLevers, Speculation

PHASES_FORMAT = "nereus.generation-phases/1"
POINTS = ("start", "look")  # before the first iteration; a later point the policy asked for
KV_CHOICES = ("cheaper", "send", "recompute")


@dataclass(frozen=True)
class TailPhase:
    """A plan's generation phases: bulk on the plan's generation placement until at most ``trigger_live``
    sequences are still generating, then a tail layout of ``tail_replicas`` replicas of TP ``tail_tp`` on
    the first GPUs of that placement (``Plan.generation``). ``kv``: each unfinished sequence sends its KV
    caches or is re-prefilled there (``cheaper``: per group of similar contexts). ``overlap``: the GPUs
    the tail frees run inference on finished samples. ``predicted``: the policy's numbers for the step."""

    trigger_live: int
    tail_tp: int
    tail_replicas: int
    overlap: bool = False
    kv: str = "cheaper"
    policy: str = ""
    predicted: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.trigger_live < 1 or self.tail_tp < 1 or self.tail_replicas < 1:
            raise ValueError(f"TailPhase: trigger_live, tail_tp and tail_replicas must be >= 1 ({self})")
        if self.kv not in KV_CHOICES:
            raise ValueError(f"TailPhase.kv: {self.kv!r}; use {', '.join(KV_CHOICES)}")

    @property
    def tail_gpus(self) -> int:
        return self.tail_tp * self.tail_replicas

    def to_dict(self) -> dict:
        return {"format": PHASES_FORMAT, **asdict(self), "predicted": dict(self.predicted)}

    def to_json(self) -> dict:
        return self.to_dict()

    @staticmethod
    def from_dict(d: dict, where: str = "generation_phases") -> TailPhase:
        check_format(d, PHASES_FORMAT, {f.name for f in fields(TailPhase)}, where)
        try:
            return TailPhase(**{k: v for k, v in d.items() if k != "format"})
        except (TypeError, ValueError) as err:
            raise SpecError(where, str(err)) from None


# ----- what the backend reports ----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class SequenceRecord:
    """One unfinished sequence: its id (the step's row), the DP replica that holds it, its prompt and
    response tokens so far, the positions whose KV caches that replica holds (0: none yet, or dropped),
    the size of its sampling stream's state (what a move sends with the record), and the backend's
    forecast of its final response length from the lengths the run has measured (0.0: none)."""

    id: int
    replica: int
    prompt: int
    generated: int
    cached: int
    rng_bytes: int = 0
    forecast: float = 0.0

    @property
    def context(self) -> int:
        return self.prompt + self.generated

    def to_json(self) -> list:
        return [self.id, self.replica, self.prompt, self.generated, self.cached, self.rng_bytes, self.forecast]

    @staticmethod
    def from_json(d: list) -> SequenceRecord:
        return SequenceRecord(*d)


@dataclass(frozen=True)
class ReplicaStatus:
    """One DP replica after a call of its engine: running (``active``) and not yet started (``queued``)
    sequences, in engine order; the sequences that ended in the call as (id, response tokens); the call's
    iterations, rows (live sequences summed over its iterations: each is a one-row forward) and the
    seconds they took."""

    replica: int
    active: tuple[SequenceRecord, ...]
    queued: tuple[SequenceRecord, ...]
    finished: tuple[tuple[int, int], ...] = ()
    iterations: int = 0
    rows: int = 0
    busy_s: float = 0.0

    @property
    def unfinished(self) -> int:
        return len(self.active) + len(self.queued)


@dataclass(frozen=True)
class Measured:
    """What the backend measured of this generation up to the decision point: per replica, rows run and
    their seconds; the mean driver overhead of a call (wall time less the slowest replica's busy time;
    None before the first call); the fixed part of a move's cost as calibrated on the run's measured
    moves (``cost.engine.move_fixed_s``; None before the first); seconds since the stage began."""

    rows: tuple[int, ...] = ()
    busy_s: tuple[float, ...] = ()
    call_overhead_s: float | None = None
    move_fixed_s: float | None = None
    elapsed_s: float = 0.0


@dataclass(frozen=True)
class GenerationStatus:
    """The generation stage at a decision point (see the module docstring). ``iteration``: engine
    iterations run so far (the most any replica ran); ``kv_token_bytes``: KV-cache bytes of one position
    over the whole model (``spec.model.kv_token_bytes``); ``phases``: the plan's generation phases;
    ``levers``: the plan's generation levers (``spec.levers``)."""

    step: int
    model_stage: str
    point: str
    iteration: int
    slots: int
    max_new_tokens: int
    replicas: tuple[ReplicaStatus, ...]
    measured: Measured = Measured()
    kv_token_bytes: int = 0
    phases: TailPhase | None = None
    levers: GenerationLevers | None = None

    def __post_init__(self) -> None:
        if self.point not in POINTS:
            raise ValueError(f"GenerationStatus.point: {self.point!r}; one of {', '.join(POINTS)}")

    @property
    def live(self) -> int:
        """Sequences running now (started, not finished)."""
        return sum(len(r.active) for r in self.replicas)


# ----- what the policy answers -----------------------------------------------------------------------

def _encode(value: Any) -> Any:
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    if isinstance(value, Mapping):
        return dict(value)
    return value


@dataclass(frozen=True)
class NextLook:
    """The next decision point: after ``iterations`` engine iterations, or once at most ``live_at_most``
    sequences are still generating; both 0: none (the stage runs to its end). The runtime's engine loop
    looks after iterations (its replicas run a chunk each between two round trips); the simulator honours
    both."""

    iterations: int = 0
    live_at_most: int = 0

    def __post_init__(self) -> None:
        if self.iterations < 0 or self.live_at_most < 0:
            raise ValueError(f"NextLook: iterations and live_at_most must be >= 0 ({self})")
        if self.iterations and self.live_at_most:
            raise ValueError("NextLook: give iterations or live_at_most, not both")

    @property
    def none(self) -> bool:
        return not (self.iterations or self.live_at_most)

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> NextLook:
        return NextLook(**d)


END = NextLook()  # no further decision point in this step


@dataclass(frozen=True, kw_only=True)
class GenerationDecision:
    """Base of the decision kinds: the next decision point and a reason in words."""

    kind: ClassVar[str] = ""
    acts: ClassVar[bool] = False  # the backend has something to carry out
    look: NextLook = END
    reason: str = ""

    @property
    def recorded(self) -> bool:
        """Whether the backend records this decision (acting ones, and declined moves)."""
        return self.acts

    def to_json(self) -> dict:
        return {"kind": self.kind, **{f.name: _encode(getattr(self, f.name)) for f in fields(self)}}

    @classmethod
    def from_json(cls, d: dict) -> GenerationDecision:
        return cls(**{f.name: cls._decode(f.name, d[f.name]) for f in fields(cls) if f.name in d})

    @classmethod
    def _decode(cls, name: str, value: Any) -> Any:
        return NextLook.from_json(value) if name == "look" else value


@dataclass(frozen=True, slots=True)
class SequenceMove:
    """One sequence to move: its record (the replica it leaves is ``seq.replica``), the replica that
    receives it, and whether the receiver re-prefills it instead of receiving its caches."""

    seq: SequenceRecord
    dst: int
    refill: bool = False

    def to_json(self) -> dict:
        return {"seq": self.seq.to_json(), "dst": self.dst, "refill": self.refill}

    @staticmethod
    def from_json(d: dict) -> SequenceMove:
        return SequenceMove(SequenceRecord.from_json(d["seq"]), d["dst"], d["refill"])


@dataclass(frozen=True, kw_only=True)
class MoveSequences(GenerationDecision):
    """Move ``moves`` between replicas of the stage's layout now; ``gain_s``, ``cost_s``: predicted
    seconds the stage saves and the move costs; ``bytes``: KV-cache bytes that travel."""

    kind: ClassVar[str] = "move_sequences"
    acts: ClassVar[bool] = True
    moves: tuple[SequenceMove, ...]
    gain_s: float = 0.0
    cost_s: float = 0.0
    bytes: int = 0

    @property
    def donor(self) -> int:
        return self.moves[0].seq.replica

    @property
    def receiver(self) -> int:
        return self.moves[0].dst

    @property
    def kv(self) -> int:
        """Running sequences whose caches travel."""
        return sum(1 for m in self.moves if m.seq.cached and not m.refill)

    @property
    def refills(self) -> int:
        """Running sequences the receiver re-prefills."""
        return sum(1 for m in self.moves if m.refill)

    @property
    def queued(self) -> int:
        """Sequences that had not started (only their records travel)."""
        return len(self.moves) - self.kv - self.refills

    @classmethod
    def _decode(cls, name: str, value: Any) -> Any:
        if name == "moves":
            return tuple(SequenceMove.from_json(m) for m in value)
        return super()._decode(name, value)


@dataclass(frozen=True, kw_only=True)
class ChangeTailLayout(GenerationDecision):
    """Switch the stage to ``phase``'s tail layout now, for every unfinished sequence."""

    kind: ClassVar[str] = "change_tail_layout"
    acts: ClassVar[bool] = True
    phase: TailPhase
    gain_s: float = 0.0
    cost_s: float = 0.0

    @classmethod
    def _decode(cls, name: str, value: Any) -> Any:
        return TailPhase.from_dict(value) if name == "phase" else super()._decode(name, value)


@dataclass(frozen=True, kw_only=True)
class Continue(GenerationDecision):
    """Nothing to do now; look again at ``look``. ``declined``: a move the policy weighed and refused
    (``reason`` says why), recorded with its numbers."""

    kind: ClassVar[str] = "continue"
    declined: MoveSequences | None = None

    @property
    def recorded(self) -> bool:
        return self.declined is not None

    @classmethod
    def _decode(cls, name: str, value: Any) -> Any:
        if name == "declined":
            return None if value is None else MoveSequences.from_json(value)
        return super()._decode(name, value)


@dataclass(frozen=True, kw_only=True)
class SetSpeculation(GenerationDecision):
    """From now on decode with ``speculation`` on every replica whose live batch is at most its
    threshold (None: off everywhere); ``gain_s``: the seconds the policy predicts it saves this step."""

    kind: ClassVar[str] = "set_speculation"
    acts: ClassVar[bool] = True
    speculation: Speculation | None
    gain_s: float = 0.0
    cost_s: float = 0.0

    @classmethod
    def _decode(cls, name: str, value: Any) -> Any:
        if name == "speculation":
            return None if value is None else Speculation.from_json(value)
        return super()._decode(name, value)


@dataclass(frozen=True, kw_only=True)
class DeferSequences(GenerationDecision):
    """End the round now: the step trains the groups that finished; ``groups`` unfinished groups drop
    their partial responses and their prompts wait for a long round (tail batching: lag 0)."""

    kind: ClassVar[str] = "defer_sequences"
    acts: ClassVar[bool] = True
    groups: int
    gain_s: float = 0.0
    cost_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class CarryOver(GenerationDecision):
    """End the round now: ``sequences`` unfinished responses keep their tokens and resume in the next
    step, whose policy then trains them with one step of lag on those tokens (partial rollout)."""

    kind: ClassVar[str] = "carry_over"
    acts: ClassVar[bool] = True
    sequences: int
    gain_s: float = 0.0
    cost_s: float = 0.0


DECISION_KINDS: Mapping[str, type[GenerationDecision]] = MappingProxyType(
    {c.kind: c for c in (Continue, MoveSequences, ChangeTailLayout, SetSpeculation, DeferSequences, CarryOver)})


def decision_from_json(d: dict) -> GenerationDecision:
    """The decision ``GenerationDecision.to_json`` wrote; a ``ValueError`` naming the known kinds otherwise."""
    cls = DECISION_KINDS.get(d.get("kind")) if isinstance(d, dict) else None
    if cls is None:
        got = d.get("kind") if isinstance(d, dict) else d
        raise ValueError(f"unknown generation decision kind {got!r}; known: {', '.join(DECISION_KINDS)}")
    return cls.from_json(d)


# ----- what happened: one entry of the run record -----------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    """What the backend did with a decision: ``applied`` (runtime: the move committed; simulator: the
    tail layout ran), why not (``reason``: refused for memory, aborted before its commit point, a kind
    this backend does not carry out, declined by the policy), the measured seconds it cost and the
    measured gain against the stage without it, and the backend's further figures by name."""

    applied: bool
    reason: str = ""
    cost_s: float | None = None
    gain_s: float | None = None
    figures: Mapping[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {**asdict(self), "figures": dict(self.figures)}

    @staticmethod
    def from_json(d: dict) -> Outcome:
        return Outcome(**d)


@dataclass(frozen=True)
class GenerationEntry:
    """One recorded decision inside a step, as ``RunRecord.add_generation`` keeps it and ``nereus report``
    tables it: where it was taken (step, model-stage, engine iteration, sequences live), the decision,
    its outcome, and the policy's own seconds deciding."""

    step: int
    model_stage: str
    iteration: int
    live: int
    decision: GenerationDecision
    outcome: Outcome
    overhead_s: float = 0.0

    def to_json(self) -> dict:
        return {"action": "generation", "step": self.step, "model_stage": self.model_stage,
                "iteration": self.iteration, "live": self.live, "decision": self.decision.to_json(),
                "outcome": self.outcome.to_json(), "overhead_s": self.overhead_s}

    @staticmethod
    def from_json(d: dict) -> GenerationEntry:
        return GenerationEntry(d["step"], d["model_stage"], d["iteration"], d["live"],
                               decision_from_json(d["decision"]), Outcome.from_json(d["outcome"]), d["overhead_s"])
