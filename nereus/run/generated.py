"""A step's generation as the RL step reads it: the packed rollout, its rows, the decisions taken inside it,
the generation's own metrics (``midstep/*``, ``tail/*``, ``partial/*`` and the decode counters) and the
inference it started on finished replicas' rows."""

from __future__ import annotations

from dataclasses import dataclass, field

from nereus.rl.data import Prompt
from nereus.run.overlap import EarlyInference
from nereus.run.rollout import Rollout
from nereus.runtime.engines.answers import DecodeStats, ReplicaRollout
from nereus.spec.generation import GenerationEntry


@dataclass(frozen=True)
class Generated:
    """A step's generation: the packed rollout and its rows, the decisions taken inside it with their
    outcomes, the generation's metrics, and the inference stages' calls already issued on its finished
    replicas' rows (``run.overlap`` with ``pad_to_max``; None without: ``StepInference.infer``)."""

    rollout: Rollout
    rows: list[Prompt]
    entries: tuple[GenerationEntry, ...] = ()
    metrics: dict[str, float] = field(default_factory=dict)
    early: EarlyInference | None = None


DECODE_METRICS = ("rollout/decode_iterations", "rollout/spec_decode/num_drafts",
                  "rollout/spec_decode/num_draft_tokens", "rollout/spec_decode/num_accepted_tokens")


def decode_metrics(parts: list[ReplicaRollout]) -> dict[str, float]:
    """The generation's decode forwards and speculation counters summed over its replicas (vLLM's
    ``spec_decode`` names: draft chains verified, draft tokens verified, drafts accepted)."""
    s = sum((p.stats for p in parts), DecodeStats())
    return dict(zip(DECODE_METRICS, map(float, (s.iterations, s.verifications, s.draft_tokens, s.accepted_tokens)),
                    strict=True))
