"""The driver's inference operations: a key's log-probs, entropies and values, combined from its
data-parallel replicas in order."""

from __future__ import annotations

import torch

from nereus.runtime.cluster.calls import Logprobs, LogprobsAndEntropy, LogprobsEntropyAndSumPiSquared, Values
from nereus.runtime.cluster.runtime_roles.core import RuntimeCore
from nereus.runtime.parallel.packing import row_lengths
from nereus.spec.packing import replica_order


class InferenceOps(RuntimeCore):
    """Issues the inference requests (``calls.Logprobs``, ``LogprobsAndEntropy``, ``Values``) on a key's
    workers through ``_on`` and concatenates the replicas' rows (``lengths``: their real tokens, which a
    packing layout runs alone); changes no state."""

    def logprobs(self, key: str, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        return self._rows(key, tokens, lengths, self._on(key, Logprobs(tokens, lengths)))

    def logprobs_and_entropy(self, key: str, tokens: torch.Tensor,
                             lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and full-vocabulary entropies [B, T−1] from one forward pass (verl's old_log_prob
        stage computes both)."""
        parts = self._on(key, LogprobsAndEntropy(tokens, lengths))
        return tuple(self._rows(key, tokens, lengths, [p[i] for p in parts]) for i in range(2))

    def logprobs_entropy_and_sum_pi_squared(self, key: str, tokens: torch.Tensor, lengths: torch.Tensor | None = None,
                                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``logprobs_and_entropy`` and Σ_v π(v)² [B, T−1] from the same pass (verl computes Σπ² in the
        old-log-prob pass with ``actor.calculate_sum_pi_squared``)."""
        parts = self._on(key, LogprobsEntropyAndSumPiSquared(tokens, lengths))
        return tuple(self._rows(key, tokens, lengths, [p[i] for p in parts]) for i in range(3))

    def values(self, key: str, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        return self._rows(key, tokens, lengths, self._on(key, Values(tokens, lengths)))

    def _rows(self, key: str, tokens: torch.Tensor, lengths: torch.Tensor | None,
              parts: list[torch.Tensor]) -> torch.Tensor:
        """The replicas' answers as one tensor in batch order: consecutive blocks of rows (padded layouts), or
        each replica's share of a packed layout's rows, dealt by tokens (``spec.packing.replica_order``)."""
        joined = torch.cat(parts)
        layout = self.specs[key].layout
        if not layout.max_token_len:
            return joined
        order = replica_order(row_lengths(lengths, len(tokens), tokens.shape[1]), layout.dp)
        out = torch.empty_like(joined)
        out[torch.tensor(order, dtype=torch.long)] = joined
        return out
