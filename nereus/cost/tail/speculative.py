"""Speculative decoding priced on the decode model, by live batch (lossless: the step stays on-policy).

A drafter proposes ``k`` tokens per live sequence; the target verifies them in one forward pass of
``k + 1`` tokens per sequence and keeps the longest accepted prefix plus one token of its own. With a
per-token acceptance rate α the expected tokens per verification are (1 − α^(k+1)) / (1 − α)
(Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative Decoding", Eq. 1).

The verification is a decode step at the live batch whose GEMMs carry (k + 1)·b rows (``StepModel``:
weight reads vs FLOPs, so it turns compute-bound at large batch), whose attention reads each sequence's
KV cache once for k + 1 queries and whose all-reduces carry (k + 1)·b activations; the engine's host
costs are paid once per iteration. Drafting costs k forwards of a draft model or head on the same
replica, or CPU-side lookups for model-free drafts (n-gram in the prompt, suffix trees over earlier
responses). The speedup is tokens × (plain step) / (verification + drafting); at small live batch the
step is weight-read bound and speculation pays, at large batch verification is FLOP-bound and it loses
(verl's MTP rollout on H20 lost about half its throughput: docs/advance/mtp.md) — so the controller
sizes k, or switches speculation off, by live batch (``best_k``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum
from functools import lru_cache

from nereus.cost.decode import DecodePhases, EngineCosts, Replica, StepModel
from nereus.spec.model import ModelArch


class DraftKind(StrEnum):
    """Where the draft tokens come from (the trace's ``acceptance`` keys, ``nereus.spec.levers.DRAFT_KINDS``)."""

    NGRAM = "ngram"  # n-gram lookup in the prompt and the response so far (vLLM "ngram", prompt lookup)
    SUFFIX = "suffix"  # suffix tree over earlier responses to the same prompt (SuffixDecoding, DAS, SPEC-RL)
    DRAFT_MODEL = "draft_model"  # a small model of the same family decoding k tokens
    DRAFT_HEAD = "draft_head"  # an EAGLE/MTP head on the target's hidden states



@dataclass(frozen=True)
class Acceptance:
    """Per-token acceptance rate α of a drafter and the evidence behind it, in verifications."""

    alpha: float
    weight: float
    source: str

    def tokens(self, k: int) -> float:
        return expected_tokens(self.alpha, k)

    def observe(self, accepted_tokens: float, verifications: float, k: int) -> Acceptance:
        """The estimate after ``verifications`` chain verifications of ``k`` drafted tokens that accepted
        ``accepted_tokens`` in total (vLLM's ``num_accepted_tokens`` / ``num_drafts``): the measured mean
        acceptance length 1 + accepted / verifications is inverted through Leviathan's formula and
        averaged with the current estimate, each weighted by its verifications."""
        if verifications <= 0:
            return self
        measured = alpha_from_acceptance_length(1 + accepted_tokens / verifications, k)
        weight = self.weight + verifications
        alpha = (self.alpha * self.weight + measured * verifications) / weight
        return Acceptance(alpha, weight, f"{self.source}; calibrated on {verifications:g} verifications")


# A prior counts as this many verifications: a running job measures thousands per step, so its own
# acceptance replaces the prior within one step.
PRIOR_WEIGHT = 100.0
# Priors per draft kind. Each is the α that Leviathan's formula gives for a published mean acceptance
# length (AL) at the published k, or a published per-token acceptance.
PRIORS: tuple[tuple[DraftKind, Acceptance], ...] = (
    # vllm-project/vllm issue 19254: n-gram drafts (k = 3) for Qwen3-32B-FP8 under load logged AL 2.16,
    # 2.46 and 2.83 (α 0.50, 0.59, 0.68), per-position acceptance 0.54–0.73 at the first position.
    (DraftKind.NGRAM, Acceptance(0.59, PRIOR_WEIGHT, "vLLM issue 19254: n-gram k=3, AL 2.16-2.83")),
    # vllm-project/vllm PR 24852 (suffix decoding in vLLM, MT-bench, k = 1): acceptance 0.62 at the first
    # token with no earlier responses cached. RL revisits each prompt every epoch, so suffix trees over
    # its earlier responses match more (DAS arXiv 2511.13841, SPEC-RL arXiv 2509.23232); traces carry it.
    (DraftKind.SUFFIX, Acceptance(0.62, PRIOR_WEIGHT, "vLLM PR 24852: suffix decoding, first-token acceptance")),
    # Leviathan et al. 2023, Table 3: T5-small/base/large drafting for T5-XXL accept about 0.6–0.8 of the
    # tokens (lower when sampling at temperature 1, as RL rollouts do).
    (DraftKind.DRAFT_MODEL, Acceptance(0.65, PRIOR_WEIGHT, "Leviathan et al. 2023, Table 3 (T=1 range)")),
    # vllm-project/vllm issue 20780: EAGLE-3 head for Llama-3.1-8B-Instruct on MT-bench, AL 2.36, 2.79,
    # 3.08, 3.32, 3.46, 3.54 at k = 2..7; α = 0.75 reproduces all six within 0.06 tokens.
    (DraftKind.DRAFT_HEAD, Acceptance(0.75, PRIOR_WEIGHT, "vLLM issue 20780: EAGLE-3 AL at k=2..7")),
)


def prior(kind: DraftKind) -> Acceptance:
    return dict(PRIORS)[kind]


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verification yields per sequence: the accepted prefix plus the target's own token,
    (1 − α^(k+1)) / (1 − α) (Leviathan et al. 2023, Eq. 1); 1 with speculation off (k = 0)."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def alpha_from_acceptance_length(length: float, k: int) -> float:
    """The α at which ``expected_tokens(α, k)`` equals a measured mean acceptance length (bisection;
    the function rises monotonically from 1 at α = 0 to k + 1 at α = 1)."""
    if k <= 0 or length <= 1.0:
        return 0.0
    if length >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < length else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Drafter:
    """A source of draft tokens: its kind, acceptance, and what drafting costs.

    ``arch``: the draft model or head (a head is a one-layer decoder at the target's width with its own
    LM head); None for model-free kinds, whose drafting is ``host_s`` CPU seconds per live sequence per
    iteration. ``forward_host_s``: the host cost of one draft forward; None charges the engine's fixed
    step cost (draft forwards launched one by one, as vLLM's drafters did before they were captured in
    CUDA graphs); 0 for engines that replay the drafter from a graph.
    """

    kind: DraftKind
    acceptance: Acceptance
    arch: ModelArch | None = None
    host_s: float = 0.0
    forward_host_s: float | None = None
    # Host costs a speculative iteration pays that the engine's plain step hides: SGLang overlaps its
    # scheduler with the GPU only without speculation (its docs: the overlap scheduler with speculation
    # is the experimental "SpecV2", topk 1 only), so for such an engine its Python scheduler's per-step
    # and per-sequence work reappears (0 for engines that never overlap, like vLLM's).
    exposed_host: EngineCosts = EngineCosts(0.0, 0.0)

    def with_alpha(self, alpha: float, source: str) -> Drafter:
        return replace(self, acceptance=Acceptance(alpha, self.acceptance.weight, source))


# CPU seconds per live sequence per iteration of a model-free lookup: vLLM's n-gram proposer matches
# the context on the CPU per request between steps (vllm-project/vllm issue 16883: ``_find_subarray_kmp``
# runs on CPU and grows with the context); 20 µs is the order of the engine's per-sequence host work
# (vLLM blog, 2024-09-05). An assumption: calibration replaces it with the job's measured step times.
MODEL_FREE_HOST_S = 20e-6


def ngram_drafter() -> Drafter:
    return Drafter(DraftKind.NGRAM, prior(DraftKind.NGRAM), host_s=MODEL_FREE_HOST_S)


def suffix_drafter() -> Drafter:
    return Drafter(DraftKind.SUFFIX, prior(DraftKind.SUFFIX), host_s=MODEL_FREE_HOST_S)


def draft_head(target: ModelArch, vocab: int | None = None, forward_host_s: float | None = None) -> Drafter:
    """An EAGLE-style head: one decoder layer of the target's shape and an LM head over ``vocab`` tokens
    (EAGLE-3 drafts over a reduced vocabulary, 32,000 for Llama-3.1-8B; EAGLE-1 over the full one)."""
    head = replace(target, layers=1, vocab=vocab or target.vocab, tied_embeddings=True)
    return Drafter(DraftKind.DRAFT_HEAD, prior(DraftKind.DRAFT_HEAD), head, forward_host_s=forward_host_s)


def draft_model(arch: ModelArch, forward_host_s: float | None = None) -> Drafter:
    return Drafter(DraftKind.DRAFT_MODEL, prior(DraftKind.DRAFT_MODEL), arch, forward_host_s=forward_host_s)


def verify_seconds(m: StepModel, batch: float, context: float, rows: int) -> float:
    """One target forward over ``rows`` tokens per live sequence (k + 1 for a chain of k drafts):
    GEMMs at rows·batch (weight reads vs FLOPs), KV reads once per sequence for ``rows`` queries, the
    all-reduces' activations for every row, the engine's costs once. ``rows = 1`` is ``m.step``."""
    b = max(1.0, batch)
    n = max(1, math.ceil(b * rows))
    gemm = max(m.read_s(n), m.compute_s(n))
    attention = b * context * max(m.kv_s_per_token, rows * m.attn_s_per_token)
    tp = m.comm_fixed + n * m.comm_per_seq if m.comm_fixed else 0.0
    return gemm + attention + tp + b * m.per_seq_s + m.fixed_s


@lru_cache(maxsize=256)
def _draft_step_model(target: Replica, arch: ModelArch, forward_host_s: float) -> StepModel:
    """The draft model or head on the target's replica (same GPUs and TP: vLLM's default draft TP), its
    host cost per forward ``forward_host_s`` and no per-sequence host cost (paid by the iteration)."""
    return StepModel(replace(target, arch=arch, engine_costs=EngineCosts(forward_host_s, 0.0)))


def draft_seconds(target: StepModel, drafter: Drafter, batch: float, context: float, k: int) -> float:
    """Drafting ``k`` tokens for each of ``batch`` sequences: k forwards of the draft model or head at the
    live batch, or the model-free lookups' CPU time."""
    if k <= 0:
        return 0.0
    if drafter.arch is None:
        return drafter.host_s * max(1.0, batch)
    host = target.replica.costs.step_s if drafter.forward_host_s is None else drafter.forward_host_s
    draft = _draft_step_model(target.replica, drafter.arch, host)
    return k * draft.step(max(1.0, batch), context).total


@dataclass(frozen=True)
class SpecIteration:
    """One draft-and-verify iteration at a live batch: seconds and tokens per sequence."""

    k: int
    batch: float
    alpha: float
    verify_s: float
    draft_s: float
    plain_step_s: float  # one ordinary decode step at the same batch and context
    tokens: float  # expected tokens per sequence per iteration

    @property
    def seconds(self) -> float:
        return self.verify_s + self.draft_s

    @property
    def speedup(self) -> float:
        """Tokens per second against plain decoding at the same live batch (1.0 when off)."""
        return self.tokens * self.plain_step_s / self.seconds


def iteration(target: StepModel, drafter: Drafter, batch: float, context: float, k: int,
              alpha: float | None = None, verify_tokens: int | None = None) -> SpecIteration:
    """A speculative iteration with ``k`` drafted tokens per sequence (``alpha``: None uses the drafter's
    acceptance; ``verify_tokens``: tokens verified per sequence, k + 1 for a chain, more for a tree)."""
    a = drafter.acceptance.alpha if alpha is None else alpha
    plain = target.step(max(1.0, batch), context).total
    if k <= 0:
        return SpecIteration(0, batch, a, plain, 0.0, plain, 1.0)
    rows = verify_tokens or k + 1
    exposed = drafter.exposed_host.step_s + max(1.0, batch) * drafter.exposed_host.sequence_s
    return SpecIteration(k, batch, a, verify_seconds(target, batch, context, rows) + exposed,
                         draft_seconds(target, drafter, batch, context, k), plain, expected_tokens(a, k))


def best_k(target: StepModel, drafter: Drafter, batch: float, context: float, k_max: int = 8,
           alpha: float | None = None) -> SpecIteration:
    """The draft length with the highest speedup at this live batch, k = 0 (off) when none beats 1."""
    best = iteration(target, drafter, batch, context, 0, alpha)
    for k in range(1, k_max + 1):
        it = iteration(target, drafter, batch, context, k, alpha)
        if it.speedup > best.speedup:
            best = it
    return best


def largest_paying_batch(target: StepModel, drafter: Drafter, context: float, k_max: int = 8,
                         alpha: float | None = None, limit: int = 4096) -> int:
    """The largest live batch (powers of two up to ``limit``, then bisection) at which some k still beats
    plain decoding: the threshold below which a controller switches speculation on; 0 when none pays."""
    def pays(b: int) -> bool:
        return best_k(target, drafter, b, context, k_max, alpha).k > 0

    if not pays(1):
        return 0
    lo = 1
    while lo < limit and pays(min(limit, 2 * lo)):
        lo = min(limit, 2 * lo)
    if lo >= limit:
        return limit
    hi = min(limit, 2 * lo)  # pays at lo, not at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if pays(mid) else (lo, mid)
    return lo


def draft_memory_bytes(drafter: Drafter, tp: int, kv_tokens: float, weight_bytes: float = 2.0) -> float:
    """Device memory a drafter takes from the replica's KV budget: its weights split over TP and the KV
    cache of its layers for ``kv_tokens`` tokens (model-free drafts hold nothing on the device)."""
    if drafter.arch is None:
        return 0.0
    a = drafter.arch
    kv = kv_tokens * a.kv_bytes_per_token(int(weight_bytes)) / min(tp, a.kv_heads)
    return a.params() * weight_bytes / tp + kv


def generation_seconds(phases: DecodePhases, target: StepModel, drafter: Drafter, context: float,
                       k_max: int = 8, alpha: float | None = None) -> float:
    """A replica's generation (``decode_phases``) with speculation at the best k for each live batch:
    the bulk at its batch, each drain segment at its live sequences; prefill unchanged."""
    bulk = phases.bulk_s / best_k(target, drafter, phases.batch, context, k_max, alpha).speedup
    tail, before = 0.0, 0.0
    for end, live in phases.drain:
        tail += (end - before) / best_k(target, drafter, live, context, k_max, alpha).speedup
        before = end
    return phases.prefill_s + bulk + tail
