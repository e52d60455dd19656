"""Sampling settings and the sampling rule shared by both generation paths (``generate``: a fixed
left-padded batch; ``decode_engine``: continuous batching)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    eos_token_id: int | None = None
    pad_token_id: int = 0
    seed: int = 0
    slots: int = 0  # > 0: the continuous-batching engine with this many slots (``decode_engine``)


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
    """Next tokens [B] from full-vocabulary logits [B, V]: argmax, or nucleus sampling (Holtzman et al.
    2020) at ``temperature`` keeping the smallest set of tokens whose probability reaches ``top_p``."""
    if params.temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the tokens ranked above
        sorted_p = sorted_p.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)
