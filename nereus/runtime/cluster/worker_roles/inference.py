"""The ``Worker``'s inference role: forward passes over a key's shard, answered by each data-parallel
replica's output rank."""

from __future__ import annotations

import torch

from nereus.runtime.cluster.calls import ReplicaOutput
from nereus.runtime.cluster.worker_roles.core import WorkerCore


class InferenceRole(WorkerCore):
    """Log-probs, entropies and values of a key's model (requests ``calls.Logprobs``,
    ``LogprobsAndEntropy``, ``LogprobsEntropyAndSumPiSquared``, ``Values``; ``lengths``: the rows' real
    tokens, which a packing layout runs alone; ``routes``: the experts to replay, router replay's); reads only
    ``models`` and changes nothing."""

    def logprobs(self, key: str, tokens: torch.Tensor,
                 lengths: torch.Tensor | None = None) -> ReplicaOutput[torch.Tensor] | None:
        return self._on(key, lambda sm: self._output(sm, sm.logprobs(tokens, lengths)))

    def logprobs_and_entropy(self, key: str, tokens: torch.Tensor, lengths: torch.Tensor | None = None,
                             routes: torch.Tensor | None = None,
                             ) -> ReplicaOutput[tuple[torch.Tensor, torch.Tensor]] | None:
        return self._on(key, lambda sm: self._output(sm, sm.logprobs_and_entropy(tokens, lengths, routes)))

    def logprobs_entropy_and_sum_pi_squared(self, key: str, tokens: torch.Tensor, lengths: torch.Tensor | None = None,
                                            routes: torch.Tensor | None = None,
                                            ) -> ReplicaOutput[tuple[torch.Tensor, ...]] | None:
        return self._on(key, lambda sm: self._output(sm, sm.logprobs_entropy_and_sum_pi_squared(tokens, lengths,
                                                                                                 routes)))

    def values(self, key: str, tokens: torch.Tensor,
               lengths: torch.Tensor | None = None) -> ReplicaOutput[torch.Tensor] | None:
        return self._on(key, lambda sm: self._output(sm, sm.values(tokens, lengths)))
