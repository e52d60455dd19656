"""Sampling settings and the sampling rule shared by both generation paths (``generate``: a fixed
left-padded batch; ``decode_engine``: continuous batching)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nereus.spec.levers import Speculation

_MASK64 = (1 << 64) - 1


def stream_seed(seed: int, index: int) -> int:
    """The seed of stream ``index`` under ``seed``: SplitMix64's finaliser (Steele et al., OOPSLA 2014) of
    the pair, so neighbouring indices (and seeds) get unrelated streams; reduced to 63 bits for
    ``torch.Generator.manual_seed``. Distinct pairs collide only by a 64-bit hash collision."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def derive_seed(seed: int, *path: int) -> int:
    """A seed derived from ``seed`` and a path of indices (e.g. purpose, step, replica), one ``stream_seed``
    per level: (seed, step, replica) and (seed, step + 1, replica − 1) get unrelated streams, which an
    arithmetic rule such as seed·K + step + replica does not give."""
    for index in path:
        seed = stream_seed(seed, index)
    return seed


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # > 0: only the k most likely tokens, before top_p (vLLM's order); -1 or 0: off
    eos_token_id: int | None = None
    pad_token_id: int = 0
    seed: int = 0
    slots: int = 0  # > 0: the continuous-batching engine with this many slots (``decode_engine``)
    # more tokens that end a sequence (vLLM's name): a model whose generation config lists several EOS ids
    stop_token_ids: tuple[int, ...] = ()
    # n-gram speculative decoding in the continuous-batching engine (``speculative``); None: off
    speculation: Speculation | None = None
    # tail batching (continuous-batching engine): stop once this many whole groups of ``group_size``
    # consecutive rows of the replica have finished, abort the rest (``decode_engine.generate_continuous``)
    keep_groups: int = 0
    group_size: int = 1
    # partial rollout: the first ``must_groups`` groups of each replica are kept whatever their finish
    # order (they were carried once already), and aborted rows come back as ``Carried`` partial responses
    must_groups: int = 0
    carry_partial: bool = False
    # per global row: tokens at the end of its prompt that a previous step generated (its length limit is
    # shortened by them); rows in ``resumed_done`` had finished already and generate nothing
    resumed: tuple[int, ...] = ()
    resumed_done: frozenset[int] = frozenset()
    # router replay (``run.router_replay``): answer each row's experts per position (``model.routes``)
    record_routes: bool = False

    @property
    def stops(self) -> frozenset[int]:
        """Every token id that ends a sequence: ``eos_token_id`` and ``stop_token_ids``."""
        return frozenset(self.stop_token_ids) | ({self.eos_token_id} if self.eos_token_id is not None else set())


def row_limit(params: SamplingParams, row: int) -> int:
    """New tokens global row ``row`` may generate: the limit less what a previous step generated for it
    (partial rollout's resumed rows; none for a row in ``resumed_done``)."""
    if row in params.resumed_done:
        return 0
    return params.max_new_tokens - (params.resumed[row] if params.resumed else 0)


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
    """Next tokens [B] from full-vocabulary logits [B, V]: argmax, or sampling at ``temperature`` among the
    ``top_k`` most likely tokens (Fan et al. 2018, arXiv:1805.04833), then nucleus sampling (Holtzman et
    al. 2020, arXiv:1904.09751) keeping the smallest set of those whose probability reaches ``top_p``."""
    if params.temperature <= 0:
        return logits.argmax(dim=-1)
    return torch.multinomial(target_probs(logits, params), 1, generator=gen).squeeze(-1)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution ``sample`` draws from at ``temperature`` > 0 (unnormalised after top-p: multinomial
    and the speculative rejection rule normalise): [B, V] from [B, V] logits. Top-k keeps every token whose
    logit reaches the k-th largest (ties kept, as vLLM's), and top-p then applies to their renormalised
    distribution, as vLLM's sampler orders them."""
    scaled = logits.float() / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = scaled.topk(params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the tokens ranked above
        sorted_p = sorted_p.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return probs
