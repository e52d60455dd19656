"""Top-k before top-p in the shared sampling rule (``runtime.engines.sampling.target_probs``), against a
plain reference on fixed logits (vLLM's mapping: tests/runtime/engines/vllm/test_vllm_engine.py)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from nereus.runtime.engines.sampling import SamplingParams, sample, target_probs


def _reference(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """The distribution vLLM samples from: tokens whose scaled logit reaches the k-th largest, renormalised,
    then the smallest prefix (by probability) whose mass reaches top_p, renormalised."""
    scaled = [x / temperature for x in logits]
    if 0 < top_k < len(scaled):
        kth = sorted(scaled, reverse=True)[top_k - 1]
        scaled = [x if x >= kth else -math.inf for x in scaled]
    z = sum(math.exp(x) for x in scaled)
    probs = [math.exp(x) / z for x in scaled]
    keep, mass = set(), 0.0
    for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
        if mass >= top_p:
            break
        keep.add(i)
        mass += probs[i]
    kept = sum(probs[i] for i in keep)
    return [probs[i] / kept if i in keep else 0.0 for i in range(len(probs))]


@pytest.mark.parametrize("top_k, top_p, temperature", [(-1, 1.0, 1.0), (0, 1.0, 0.7), (1, 1.0, 1.0), (3, 1.0, 1.0),
                                                       (3, 0.6, 1.0), (5, 0.9, 0.5), (8, 0.5, 2.0), (20, 1.0, 1.0)])
def test_top_k_then_top_p_matches_the_reference(top_k, top_p, temperature):
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.5, 0.0, 3.0, -2.0, 1.0], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]])
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    got = target_probs(logits, params)
    got = got / got.sum(dim=-1, keepdim=True)
    for row in range(logits.shape[0]):
        want = _reference(logits[row].tolist(), temperature, top_k, top_p)
        assert got[row].tolist() == pytest.approx(want, abs=1e-6)


def test_top_k_keeps_ties_and_one_is_greedy():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_k=1))
    assert (probs[0] > 0).tolist() == [False, True, True, False]  # both tokens at the k-th logit stay
    logits = torch.tensor([[0.3, 2.5, -1.0, 2.4, 0.0]])
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, top_k=1)
    assert {int(sample(logits, params, gen)) for _ in range(50)} == {1}
    assert {int(sample(logits, replace(params, top_k=2), gen)) for _ in range(200)} == {1, 3}

