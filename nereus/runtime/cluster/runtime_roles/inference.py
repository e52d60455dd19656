"""The driver's inference operations: a key's log-probs, entropies and values, combined from its
data-parallel replicas in order."""

from __future__ import annotations

import torch

from nereus.runtime.cluster.calls import Logprobs, LogprobsAndEntropy, LogprobsEntropyAndSumPiSquared, Values
from nereus.runtime.cluster.runtime_roles.core import RuntimeCore


class InferenceOps(RuntimeCore):
    """Issues the inference requests (``calls.Logprobs``, ``LogprobsAndEntropy``, ``Values``) on a key's
    workers through ``_on`` and concatenates the replicas' rows (``lengths``: their real tokens, which a
    packing layout runs alone); changes no state."""

    def logprobs(self, key: str, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        return torch.cat(self._on(key, Logprobs(tokens, lengths)))

    def logprobs_and_entropy(self, key: str, tokens: torch.Tensor,
                             lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and full-vocabulary entropies [B, T−1] from one forward pass (verl's old_log_prob
        stage computes both)."""
        parts = self._on(key, LogprobsAndEntropy(tokens, lengths))
        return torch.cat([lp for lp, _ in parts]), torch.cat([h for _, h in parts])

    def logprobs_entropy_and_sum_pi_squared(self, key: str, tokens: torch.Tensor, lengths: torch.Tensor | None = None,
                                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``logprobs_and_entropy`` and Σ_v π(v)² [B, T−1] from the same pass (verl computes Σπ² in the
        old-log-prob pass with ``actor.calculate_sum_pi_squared``)."""
        parts = self._on(key, LogprobsEntropyAndSumPiSquared(tokens, lengths))
        return tuple(torch.cat([p[i] for p in parts]) for i in range(3))

    def values(self, key: str, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        return torch.cat(self._on(key, Values(tokens, lengths)))
