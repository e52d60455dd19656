"""The levers that shorten the generation tail, as typed fields of a plan (``Plan.levers``).

Each lever is a frozen value with a JSON round-trip; ``GenerationLevers`` holds the ones a plan's generation
stage uses (None: off) and the policy lag they imply. The policy chooses them between steps from their
pricing (``cost.tail``) within ``run.policy_lag``, and turns them into the decisions inside the step
(``spec.generation``: ``set_speculation``, ``defer_sequences``, ``carry_over``):

- ``Speculation``: draft-and-verify decoding on while a replica's live batch is small (lag 0);
- ``TailBatching``: over-launch, stop once the step's groups finished, defer the rest (RollPacker; lag 0);
- ``PartialRollout``: a per-step token budget, unfinished responses carried over (APRIL, Kimi k1.5; lag 1);
- ``AsyncSplit``: generation of a later step on part of the GPUs while the rest train (verl's one-step-off).

Plain data only; imports nothing below ``spec``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from types import MappingProxyType
from typing import Any

from nereus.spec.errors import SpecError, check_format

LEVERS_FORMAT = "nereus.generation-levers/1"
# tail batching's stop rule: end a round once the step's prompt groups have all finished (RollPacker)
STOP_RULES = ("groups_done",)
POLICY_LAGS = (0, 1)  # run.policy_lag: 0 strictly on-policy; 1 one step of lag allowed
# Kinds of speculative drafts (the trace's ``acceptance`` keys; ``cost.tail.speculative``): n-gram lookup
# in the prompt, suffix trees over earlier responses to the same prompt, a draft model, a draft head.
DRAFT_KINDS = ("ngram", "suffix", "draft_model", "draft_head")


# the n-gram lookup's fields of ``Speculation``: in its JSON only where they differ from their defaults
LOOKUP_FIELDS = ("prompt_lookup_max", "prompt_lookup_min")


def _from_fields(cls: type, d: Any, where: str) -> Any:
    """``cls(**d)`` with unknown keys and bad values as one-line ``SpecError``\\ s naming the key."""
    if not isinstance(d, dict):
        raise SpecError(where, f"expected a mapping, got {type(d).__name__}")
    known = {f.name for f in fields(cls)}
    extra = sorted(set(d) - known)
    if extra:
        raise SpecError(f"{where}.{extra[0]}", f"unknown key; known: {', '.join(sorted(known))}")
    try:
        return cls(**d)
    except (TypeError, ValueError) as err:
        raise SpecError(where, str(err)) from None


@dataclass(frozen=True)
class Speculation:
    """Draft-and-verify decoding: ``draft_tokens`` (k) drafts of kind ``draft`` per live sequence, verified
    in one forward of k + 1 tokens; on for each replica while its live batch is at most ``live_at_most``
    (speculation loses at large batch: verification turns compute-bound). Lossless: policy lag 0.

    The same value is the policy's decision and what the engine carries out: a model-free draft (``ngram``,
    ``suffix``) looks up the sequence's last ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens in
    the text at hand (vLLM's n-gram keys; ``run.rollout.speculative`` reads into this type)."""

    draft: str
    draft_tokens: int
    live_at_most: int
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1

    def __post_init__(self) -> None:
        if self.draft not in DRAFT_KINDS:
            raise ValueError(f"Speculation.draft: {self.draft!r}; one of {', '.join(DRAFT_KINDS)}")
        if self.draft_tokens < 1 or self.live_at_most < 1:
            raise ValueError(f"Speculation: draft_tokens and live_at_most must be >= 1 ({self})")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("Speculation: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")

    def to_json(self) -> dict:
        """The lever's fields; the n-gram lookup's only where they differ from their defaults, so plans
        and records written before those fields existed read the same."""
        defaults = {f.name: f.default for f in fields(self) if f.name in LOOKUP_FIELDS}
        return {k: v for k, v in asdict(self).items() if k not in defaults or v != defaults[k]}

    @staticmethod
    def from_json(d: dict, where: str = "speculation") -> Speculation:
        return _from_fields(Speculation, d, where)


@dataclass(frozen=True)
class TailBatching:
    """RollPacker's tail batching: launch ``over_launch`` × the step's prompt groups, end the round by
    ``stop`` (once the step's groups have finished), defer the unfinished groups whole to long rounds."""

    over_launch: float
    stop: str = "groups_done"

    def __post_init__(self) -> None:
        if not self.over_launch >= 1.0:
            raise ValueError(f"TailBatching.over_launch: {self.over_launch}; must be >= 1")
        if self.stop not in STOP_RULES:
            raise ValueError(f"TailBatching.stop: {self.stop!r}; one of {', '.join(STOP_RULES)}")

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict, where: str = "tail_batching") -> TailBatching:
        return _from_fields(TailBatching, d, where)


@dataclass(frozen=True)
class PartialRollout:
    """A per-step budget of ``round_tokens`` new tokens per response; unfinished ones carry over (lag 1)."""

    round_tokens: int

    def __post_init__(self) -> None:
        if self.round_tokens < 1:
            raise ValueError(f"PartialRollout.round_tokens: {self.round_tokens}; must be >= 1")

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict, where: str = "partial_rollout") -> PartialRollout:
        return _from_fields(PartialRollout, d, where)


@dataclass(frozen=True)
class AsyncSplit:
    """Bounded asynchrony: generation of step k + ``staleness`` on ``generation_gpus`` GPUs overlapping
    training of step k on the rest."""

    generation_gpus: int
    staleness: int = 1

    def __post_init__(self) -> None:
        if self.generation_gpus < 1 or self.staleness < 1:
            raise ValueError(f"AsyncSplit: generation_gpus and staleness must be >= 1 ({self})")

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict, where: str = "async_split") -> AsyncSplit:
        return _from_fields(AsyncSplit, d, where)


_LEVER_TYPES: Mapping[str, Any] = MappingProxyType({
    "speculation": Speculation, "tail_batching": TailBatching, "partial_rollout": PartialRollout,
    "async_split": AsyncSplit})


@dataclass(frozen=True)
class GenerationLevers:
    """The levers of a plan's generation stage (each None: off) and the policy's numbers for them.
    ``policy_lag``: the most steps a trained token may lag the policy, which ``run.policy_lag`` bounds."""

    speculation: Speculation | None = None
    tail_batching: TailBatching | None = None
    partial_rollout: PartialRollout | None = None
    async_split: AsyncSplit | None = None
    policy: str = ""
    predicted: Mapping[str, float] = field(default_factory=dict, compare=False)

    @property
    def policy_lag(self) -> int:
        lagged = [self.async_split.staleness] if self.async_split else []
        return max([0, *lagged, 1 if self.partial_rollout else 0])

    def _set(self) -> dict[str, Speculation | TailBatching | PartialRollout | AsyncSplit]:
        pairs = (("speculation", self.speculation), ("tail_batching", self.tail_batching),
                 ("partial_rollout", self.partial_rollout), ("async_split", self.async_split))
        return {name: value for name, value in pairs if value is not None}

    @property
    def any(self) -> bool:
        return bool(self._set())

    @property
    def kinds(self) -> str:
        """The levers that are on, by name, joined by ``+`` ("" when none)."""
        return "+".join(self._set())

    def to_dict(self) -> dict:
        out: dict = {"format": LEVERS_FORMAT, **{k: v.to_json() for k, v in self._set().items()}}
        return {**out, "policy": self.policy, "predicted": dict(self.predicted)}

    def to_json(self) -> dict:
        return self.to_dict()

    @staticmethod
    def from_dict(d: Any, where: str = "generation_levers") -> GenerationLevers:
        check_format(d, LEVERS_FORMAT, {*_LEVER_TYPES, "policy", "predicted", "format"}, where)
        values = {name: None if d.get(name) is None else cls.from_json(d[name], f"{where}.{name}")
                  for name, cls in _LEVER_TYPES.items()}
        predicted = d.get("predicted", {})
        if not isinstance(predicted, dict):
            raise SpecError(f"{where}.predicted", "expected a mapping of names to numbers")
        return GenerationLevers(**values, policy=str(d.get("policy", "")), predicted=predicted)


def check_policy_lag(lag: Any, where: str = "run.policy_lag") -> int:
    """``run.policy_lag`` as an int of ``POLICY_LAGS``; a one-line ``SpecError`` naming the key otherwise."""
    if isinstance(lag, bool) or lag not in POLICY_LAGS:
        raise SpecError(where, f"{lag!r}; give 0 (strictly on-policy: layouts, speculative decoding, tail "
                               "batching) or 1 (also partial rollout and one-step asynchrony)")
    return int(lag)
