"""The forward operations of a ``ShardedModel`` (``sharded``): raw outputs, logits, next-token log-probs
with entropies and Σπ², and values of this replica's rows, padded or packed as the layout says
(``parallel.packing``). Results are complete on the replica's last pipeline stage, None elsewhere."""

from __future__ import annotations

from collections.abc import Callable

import torch

from nereus.runtime.parallel.batch import TrainBatch
from nereus.runtime.parallel.packing import PackedRows
from nereus.runtime.parallel.pp import forward_only
from nereus.runtime.parallel.tp import (
    gather_vocab,
    parallel_entropy,
    parallel_entropy_and_sum_pi_squared,
    parallel_logprobs,
)

# per-token quantities of next-token logit shards [.., n, V_local] and the next tokens [.., n]
Measure = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]


class ForwardOps:
    """The read-only passes of ``ShardedModel``, which supplies the model, groups, micro-batching and memory
    meter these use."""

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, routes: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Raw last-stage outputs per micro-batch of ``tokens`` (vocabulary-shard logits, or values); []
        elsewhere. ``routes``: the experts to replay ([B, T, sparse layers, k], ``model.routes``), or None."""
        mbs = self.micro_batches(TrainBatch(tokens, routes=routes))
        run, shape = self._stage_fn(mbs)
        with self.meter.track(exclude=self.model.parameters()):
            outs = forward_only(run, self.comm, [mb.tokens for mb in mbs], shape, self.dtype)
        self.record_memory("forward", activations=self.meter.peak)
        return outs

    @torch.no_grad()
    def packed_forward(self, tokens: torch.Tensor, lengths: torch.Tensor | None, routes: torch.Tensor | None = None,
                       ) -> list[tuple[PackedRows, torch.Tensor, torch.Tensor]]:
        """(packing, packed tokens [1, L], raw last-stage output [1, L, ...]) per packed micro-batch of this
        replica's rows of ``tokens`` (packings' rows index ``tokens``); [] off the last stage. The rows are
        dealt over DP by tokens as training deals them (``spec.packing.replica_shares``), so the replicas
        finish together and the cost model's fullest replica is the runtime's; the driver puts the
        replicas' answers back in batch order (``spec.packing.replica_order``)."""
        mbs = self.packed_micro_batches(TrainBatch(tokens, lengths=lengths, routes=routes))
        packs, inputs = [p for _, p in mbs], [p.pack(mb.tokens) for mb, p in mbs]
        run, shape = self._packed_stage_fn(packs, None, [mb for mb, _ in mbs])
        with self.meter.track(exclude=self.model.parameters()):
            outs = forward_only(run, self.comm, inputs, shape, self.dtype)
        self.record_memory("forward", activations=self.meter.peak)
        return list(zip(packs, inputs, outs, strict=True)) if outs else []

    def logits(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits [b, T, V] of this replica's rows (last stage), else None."""
        outs = [gather_vocab(o, self.groups.tp_group) for o in self.forward(tokens)]
        return torch.cat(outs) if outs else None

    def logprobs(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None,
                 routes: torch.Tensor | None = None) -> torch.Tensor | None:
        """log p(tokens[:, t+1] | tokens[:, :t+1]) [b, T−1] of this replica's rows (last stage), else None.
        ``lengths``: each row's real tokens (packing layouts run only those; 0 past them); ``routes``: the
        experts to replay (router replay), or None."""
        found = self._next_token_measures(tokens, lengths, lambda z, t: (
            parallel_logprobs(z, t, self.vocab_start, self.groups.tp_group),), routes)
        return None if found is None else found[0]

    def _next_token_measures(self, tokens: torch.Tensor, lengths: torch.Tensor | None, measure: Measure,
                             routes: torch.Tensor | None = None) -> tuple[torch.Tensor, ...] | None:
        """``measure(logit shards [.., n, V_local], next tokens [.., n])`` of this replica's rows from one
        forward pass, each result in the next-token frame [b, T−1] (last stage), else None."""
        if not self.token_budget:
            outs = self.forward(tokens, routes)
            if not outs:
                return None
            mine = tokens[self.replica_rows(len(tokens))].to(self.groups.device)
            with torch.no_grad():
                return measure(torch.cat(outs)[:, :-1], mine[:, 1:])
        found = self.packed_forward(tokens, lengths, routes)
        if not found:
            return None
        width, results, at = tokens.shape[1] - 1, None, _share_positions(found)
        with torch.no_grad():
            for pack, packed, out in found:
                got = measure(out, pack.next_tokens(packed))
                if results is None:
                    results = [g.new_zeros((len(at), width)) for g in got]
                for r, g in zip(results, got, strict=True):
                    r[_positions(at, pack).to(r.device)] = pack.unpack(g, width, next_token=True)
        return tuple(results)

    def logprobs_and_entropy(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None,
                             routes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``logprobs`` and the full-vocabulary entropy [b, T−1] of each next-token distribution, from one
        forward pass (last stage), else None."""
        tp = self.groups.tp_group
        return self._next_token_measures(tokens, lengths, lambda z, t: (
            parallel_logprobs(z, t, self.vocab_start, tp), parallel_entropy(z, tp)), routes)

    def logprobs_entropy_and_sum_pi_squared(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None,
                                            routes: torch.Tensor | None = None,
                                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``logprobs_and_entropy`` and Σ_v π(v)² [b, T−1] of each next-token distribution (the optimal
        token baseline's input), from the same forward pass and the same vocabulary shards (last stage),
        else None."""
        tp = self.groups.tp_group
        return self._next_token_measures(tokens, lengths, lambda z, t: (
            parallel_logprobs(z, t, self.vocab_start, tp), *parallel_entropy_and_sum_pi_squared(z, tp)), routes)

    def values(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor | None:
        """Value-head outputs [b, T] of this replica's rows (last stage; packing layouts: 0 past ``lengths``),
        else None."""
        if not self.cfg.value_head:
            raise ValueError("values need a model with a value head (score.weight)")
        if not self.token_budget:
            outs = self.forward(tokens)
            return torch.cat(outs) if outs else None
        found = self.packed_forward(tokens, lengths)
        if not found:
            return None
        at = _share_positions(found)
        out = found[0][2].new_zeros((len(at), tokens.shape[1]))
        for pack, _, y in found:
            out[_positions(at, pack).to(out.device)] = pack.unpack(y, tokens.shape[1], next_token=False)
        return out


def _share_positions(found: list[tuple[PackedRows, torch.Tensor, torch.Tensor]]) -> dict[int, int]:
    """Batch row -> its place among this replica's rows in batch order (a packed inference answers its share
    of the batch so: ``spec.packing.replica_order``)."""
    return {row: i for i, row in enumerate(sorted(r for pack, _, _ in found for r in pack.rows.tolist()))}


def _positions(at: dict[int, int], pack: PackedRows) -> torch.Tensor:
    return torch.tensor([at[r] for r in pack.rows.tolist()], dtype=torch.long)

