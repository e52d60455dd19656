"""Prompt groups in the simulator's ground truth: siblings alike, and tail batching's deferred prompts.

A step draws its responses per prompt group: with the trace's sibling correlation ρ of log lengths
(``length_correlation.siblings``) a group of G responses shares its prompt's difficulty,

    log L = μ + σ (√ρ · Z_prompt + √(1 − ρ) · Z_response),   μ the trace's (``ResponseLength.mu``),

so one response's marginal is the trace's log-normal for every ρ (``cost.tail.lengths`` prices the same
law). With ρ = 0 or G = 1 the draw is the independent one of ``SimBackend.draw_lengths``.

Tail batching (RollPacker, arXiv 2509.21009) with over-launch f: a short round launches f·P groups and
the engine stops once P groups have ended (the P-th group to finish sets the round's time); the other
groups' partial responses are dropped and their prompts (their Z_prompt) wait in ``Deferred``. Once P
are waiting, the step is a long round: those prompts are regenerated from scratch, fresh responses of the
same difficulty, run to their end. Every trained token comes from the current policy (lag 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from nereus.spec.response import ResponseLength


def draw_groups(rng: np.random.Generator, resp: ResponseLength, z_prompt: np.ndarray, group_size: int,
                siblings: float) -> np.ndarray:
    """``len(z_prompt)`` groups of ``group_size`` lengths (group j: indices j·G .. j·G + G − 1)."""
    mu = resp.mu
    z_response = rng.standard_normal(len(z_prompt) * group_size)
    z = math.sqrt(siblings) * np.repeat(z_prompt, group_size) + math.sqrt(1 - siblings) * z_response
    return np.minimum(np.exp(mu + resp.sigma * z), resp.max)


@dataclass(frozen=True)
class Deferred:
    """Prompts waiting for a long round: their difficulty Z_prompt, oldest first."""

    z: np.ndarray

    @staticmethod
    def none() -> Deferred:
        return Deferred(np.zeros(0))

    def __len__(self) -> int:
        return len(self.z)


@dataclass(frozen=True)
class ShortRound:
    """A short round's stop: its time (the P-th group to end) and which groups it keeps."""

    stop_s: float
    kept: np.ndarray  # bool per group

    def kept_sequences(self, group_size: int) -> np.ndarray:
        return np.repeat(self.kept, group_size)


def stop_round(finish_s: np.ndarray, group_size: int, keep: int) -> ShortRound:
    """The engine stops once ``keep`` groups have ended (a group ends with its last response)."""
    ends = finish_s.reshape(-1, group_size).max(axis=1)
    order = np.argsort(ends, kind="stable")
    kept = np.zeros(len(ends), bool)
    kept[order[:keep]] = True
    return ShortRound(float(ends[order[keep - 1]]), kept)
